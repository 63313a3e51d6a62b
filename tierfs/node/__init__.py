"""One node's agent: the job state machine, sealing, the client view and the restore rounds."""
