"""Per-format completeness checks of a step: would its framework load it? (issue #15).

``judge_step(StepFiles) -> Verdict``: pure functions over the step's files
(relative path -> size, across every known rank's part) and a callable that
reads local bytes. One module per format: :mod:`.dcp` (with the safe
``.metadata`` reader :mod:`.dcp_pickle`), :mod:`.orbax`, :mod:`.safetensors`,
:mod:`.archive` (torch.save zips, ``.npz``), :mod:`.numpy_npy`,
:mod:`.hf_index`, :mod:`.trackers` (Megatron, DeepSpeed), :mod:`.markers`
(temp names, NeMo). The rules and their sources: docs/SEMANTICS.md.
"""

from tierfs.store.validators.judge import judge_step, step_files_from_manifests
from tierfs.store.validators.model import Kind, Problem, Reader, StepFiles, Verdict
from tierfs.store.validators.snapshot import READ_LIMIT, checked_reader, dir_reader

__all__ = [
    "READ_LIMIT",
    "Kind",
    "Problem",
    "Reader",
    "StepFiles",
    "Verdict",
    "checked_reader",
    "dir_reader",
    "judge_step",
    "step_files_from_manifests",
]
