"""The kernel FUSE protocol and the namespace it serves (include/uapi/linux/fuse.h)."""
