"""Hugging Face sharded checkpoints: the ``*.index.json`` names only present shards.

``transformers`` (``modeling_utils.py``, ``save_pretrained`` with
``max_shard_size``; ``load_sharded_checkpoint``) and ``huggingface_hub``
(``split_torch_state_dict_into_shards``) write ``model.safetensors.index.json``
or ``pytorch_model.bin.index.json``: ``{"metadata": {"total_size": bytes of
tensor data}, "weight_map": {tensor name: shard file name}}``, the shards in the
same directory. Loading opens every shard the map names; a missing one fails
(transformers#35782: an auto-resume took a checkpoint whose index named a
shard that was not there). torch's ``HuggingFaceStorageWriter`` writes the same
index beside its safetensors shards.

The rule: the index parses; every shard it names is present (in any rank's
part) and not empty; the shards add up to at least ``total_size`` bytes; and
for a local safetensors shard, its header holds every tensor the map assigns
to it.
"""

from __future__ import annotations

import json
import posixpath

from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, base, parent, read_bytes

INDEX_SUFFIX = ".index.json"
MAX_INDEX = 256 << 20


def index_files(files: StepFiles) -> list[str]:
    """The ``*.index.json`` files of the step."""
    return [p for p, _ in files.step_files() if base(p).endswith(INDEX_SUFFIX)]


def check_hf_index(files: StepFiles, path: str, out: Findings) -> None:
    """Judge one index file against the shards (run after the per-file checks)."""
    out.checked.add(path)
    size = files.sizes[path]
    if size == 0:
        out.format("hf-sharded")
        out.damaged(path, "0 bytes: a sharded checkpoint's index is JSON, never empty")
        return
    if size > MAX_INDEX:
        return
    try:
        data = read_bytes(files, path)
    except ReadFailed as exc:
        out.format("hf-sharded")
        out.unreadable(path, str(exc))
        return
    try:
        index = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        out.format("hf-sharded")
        out.damaged(path, "not JSON: cut off or overwritten")
        return
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return  # another kind of index file: not a sharded checkpoint
    out.format("hf-sharded")
    directory = parent(path)
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if isinstance(shard, str):
            shards.setdefault(shard, []).append(str(tensor))
    total, all_present = 0, True
    for shard, tensors in sorted(shards.items()):
        target = posixpath.normpath(posixpath.join(directory, shard))
        out.checked.add(target)
        if target not in files.sizes:
            out.missing(
                target,
                f"absent; {base(path)} maps {len(tensors)} tensors (e.g. {tensors[0]!r}) to it",
            )
            all_present = False
            continue
        total += files.sizes[target]
        if files.sizes[target] == 0:
            out.damaged(target, f"0 bytes; {base(path)} maps {len(tensors)} tensors to it")
            continue
        names = out.tensor_names.get(target)
        if names is not None:
            absent = sorted(set(tensors) - names)
            if absent:
                out.damaged(
                    target,
                    f"lacks {len(absent)} tensors {base(path)} maps to it (e.g. {absent[0]!r})",
                )
    meta = index.get("metadata")
    want = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(want, bool) or not isinstance(want, (int, float)):
        return
    if all_present and total < want:
        out.damaged(
            path,
            f"its shards hold {total} bytes, fewer than its total_size {int(want)}",
        )
