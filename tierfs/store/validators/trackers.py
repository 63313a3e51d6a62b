"""Megatron and DeepSpeed steps, and their tracker files.

* Megatron-LM (``megatron/training/checkpointing.py``:
  ``get_checkpoint_tracker_filename``, ``read_metadata``,
  ``get_checkpoint_name``): ``latest_checkpointed_iteration.txt`` beside the
  steps holds the iteration (or ``release``), written after the step
  directory ``iter_<7 digits>/`` (or ``release/``). Inside: the legacy format,
  ``mp_rank_<tp>[_<pp>]/model_optim_rng.pt`` (torch.save) per model-parallel
  rank, or the distributed format, ``metadata.json``
  (``{"sharded_backend": "torch_dist", ...}``, megatron/core
  ``dist_checkpointing/core.py``) plus a DCP checkpoint (``.metadata``,
  ``__<r>_<n>.distcp``) and ``common.pt``.
* DeepSpeed (``deepspeed/runtime/engine.py``, ``save_checkpoint`` and
  ``_get_ckpt_name``/``_get_zero_ckpt_name``): ``latest`` holds the tag (by
  default ``global_step<N>``) of ``<tag>/``, which holds
  ``mp_rank_<mp>_model_states.pt`` (or ``zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt``
  with ZeRO-3, ``layer_*-model_states.pt`` with pipelines) and
  ``[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt`` per data-parallel
  rank; ``load_checkpoint`` reads ``latest`` and then those files.

The rule: a tracker that is part of the step names this step's directory
(field note 13: a pointer must never outrun the data), and that directory
has the files the framework reads; the torch.save and DCP files in it are
judged by their own modules.
"""

from __future__ import annotations

import json
import re

from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, base, read_bytes

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
MEGATRON_STEP = re.compile(r"^(iter_\d{7}|release)$")
MP_RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3})?$")
ZERO_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
MAX_TRACKER = 4096


def megatron_dir_name(text: str) -> str | None:
    """The step directory a Megatron tracker's text names, or None if malformed."""
    text = text.strip()
    if text == "release":
        return "release"
    return f"iter_{int(text):07d}" if text.isdigit() else None


def _tracker_text(files: StepFiles, path: str, out: Findings) -> str | None:
    out.checked.add(path)
    if files.sizes[path] == 0:
        out.damaged(path, "0 bytes: the tracker names no step")
        return None
    try:
        data = read_bytes(files, path, 0, min(files.sizes[path], MAX_TRACKER))
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        out.damaged(path, "not text: the tracker names no step")
        return None


def check_trackers(files: StepFiles, out: Findings) -> None:
    """Judge the tracker files that are part of the step (top-level paths)."""
    if MEGATRON_TRACKER in files.sizes:
        out.format("megatron")
        text = _tracker_text(files, MEGATRON_TRACKER, out)
        if text is not None:
            named = megatron_dir_name(text)
            if named is None:
                out.damaged(MEGATRON_TRACKER, f"holds {text.strip()[:40]!r}, not an iteration")
            elif named != files.name:
                out.missing(named, f"named by {MEGATRON_TRACKER}, but this step is {files.name}")
    if DEEPSPEED_TRACKER in files.sizes:
        out.format("deepspeed")
        text = _tracker_text(files, DEEPSPEED_TRACKER, out)
        if text is not None:
            tag = text.strip()
            if not tag or "/" in tag:
                out.damaged(DEEPSPEED_TRACKER, f"holds {tag[:40]!r}, not a checkpoint tag")
            elif tag != files.name:
                out.missing(tag, f"named by {DEEPSPEED_TRACKER}, but this step is {files.name}")


def check_megatron_dir(files: StepFiles, out: Findings) -> None:
    """Judge a Megatron step directory's own files (legacy or torch_dist)."""
    step = files.name
    meta = f"{step}/metadata.json"
    rank_dirs = sorted(
        {
            p.split("/")[1]
            for p, _ in files.step_files()
            if p.count("/") >= 2 and MP_RANK_DIR.match(p.split("/")[1])
        }
    )
    if meta in files.sizes:
        backend = _backend(files, meta, out)
        if backend is not None:
            out.format("megatron")
        if backend == "torch_dist" and f"{step}/.metadata" not in files.sizes:
            out.missing(f"{step}/.metadata", "absent: metadata.json says torch_dist (a DCP save)")
    elif rank_dirs:
        out.format("megatron")
        for d in rank_dirs:
            model = f"{step}/{d}/model_optim_rng.pt"
            if model not in files.sizes:
                out.missing(model, f"absent: Megatron's legacy format has one per {d}")


def _backend(files: StepFiles, path: str, out: Findings) -> str | None:
    out.checked.add(path)
    if files.sizes[path] == 0:
        out.damaged(path, "0 bytes: Megatron's metadata.json is never empty")
        return None
    if not files.readable(path) or files.sizes[path] > MAX_TRACKER * 16:
        return None
    try:
        doc = json.loads(read_bytes(files, path))
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return None
    except (UnicodeDecodeError, ValueError):
        out.damaged(path, "not JSON: cut off or overwritten")
        return None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    return backend if isinstance(backend, str) else None


def check_deepspeed_dir(files: StepFiles, out: Findings) -> None:
    """Judge a DeepSpeed tag directory: model states present, ZeRO ranks without a gap."""
    names = [base(p) for p, _ in files.step_files() if p.count("/") == 1]
    model = [n for n in names if n.endswith("model_states.pt")]
    optim = [m for n in names if (m := ZERO_OPTIM.match(n))]
    if not model and not optim:
        return
    out.format("deepspeed")
    if not model:
        out.missing(
            f"{files.name}/mp_rank_00_model_states.pt",
            "absent: DeepSpeed's load_checkpoint reads the model states first",
        )
    per_mp: dict[str, set[int]] = {}
    for m in optim:
        per_mp.setdefault(m["mp"], set()).add(int(m["dp"]))
    for mp, dps in sorted(per_mp.items()):
        for dp in sorted(set(range(max(dps) + 1)) - dps):
            out.missing(
                f"{files.name}/zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt",
                f"absent while data-parallel rank {max(dps)}'s optimizer states exist",
            )
