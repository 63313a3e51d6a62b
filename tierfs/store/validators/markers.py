"""Names that say a save is not finished: temp directories and NeMo's marker.

* Orbax writes into ``<step>.orbax-checkpoint-tmp[-<n>]`` and renames it
  (``path/atomicity.py``, ``TMP_DIR_SUFFIX``); item directories inside a step
  are temp-named the same way until finalized.
* Hugging Face ``Trainer`` (``trainer.py``, ``_save_checkpoint``) writes
  ``tmp-checkpoint-<N>`` and renames it to ``checkpoint-<N>``.
* NeMo (``nemo/lightning/pytorch/callbacks/model_checkpoint.py``,
  ``ModelCheckpoint.set_checkpoint_unfinished_marker``) touches
  ``<checkpoint>-unfinished`` beside the checkpoint on global rank 0 before the
  save and removes it after; ``format_checkpoint_unfinished_marker_path`` strips
  ``.ckpt`` and ``-EMA`` first. While it exists NeMo treats the checkpoint as
  unfinished and deletes it at the next start.
* DCP writes ``.metadata.tmp`` and renames it (judged in :mod:`.dcp`).
"""

from __future__ import annotations

from tierfs.store.validators.model import Findings, StepFiles

ORBAX_TMP = ".orbax-checkpoint-tmp"
HF_TMP = "tmp-checkpoint-"
NEMO_SUFFIX = "-unfinished"


def nemo_markers(name: str) -> tuple[str, ...]:
    """The marker names NeMo would use for a checkpoint called ``name``."""
    stripped = name.removesuffix(".ckpt").removesuffix("-EMA")
    return tuple(dict.fromkeys((name + NEMO_SUFFIX, stripped + NEMO_SUFFIX)))


def check_markers(files: StepFiles, out: Findings) -> None:
    """Temp names of the step itself and NeMo's ``-unfinished`` marker beside it."""
    name = files.name
    if ORBAX_TMP in name or name.startswith(HF_TMP) or name.endswith(NEMO_SUFFIX):
        out.unfinished(name, "a temp name: the framework renames it when the save is done")
    for marker in nemo_markers(name):
        if marker in files.siblings or marker in files.sizes:
            out.format("nemo")
            out.unfinished(marker, f"NeMo's marker is present: the save of {name} has not finished")
