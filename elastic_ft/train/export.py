"""Export a committed checkpoint as a Hugging Face / PEFT directory.

LoRA runs give ``adapter_config.json`` + ``adapter_model.safetensors`` that
``PeftModel.from_pretrained(base, DIR)`` loads. A base model built from an
inline config (no hub name to point at) is rebuilt from the spec stored in the
checkpoint, deterministic from its seed, and written to ``DIR/base`` with its
tokenizer; the adapter's ``base_model_name_or_path`` then points there. Full
fine-tunes export a complete model directory. The tokenizer is saved in
``DIR`` too, made to put BOS first as training does. A sharded checkpoint
(``parallelism.strategy: fsdp``) exports the same way: its shards are put
together whole in this one process first.
"""

from __future__ import annotations

import json
import os

from elastic_ft.checkpoint.manifest import manifest_key
from elastic_ft.checkpoint.reader import load_blobs, load_newest, read_manifest
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded_full
from elastic_ft.checkpoint.store import StoreError, open_store
from elastic_ft.config import spec_from_dict
from elastic_ft.checkpoint.filemode import FileTree
from elastic_ft.train import model as model_mod


def export(uri: str, out: str, *, step: int | None = None) -> dict:
    """Write the checkpoint at ``step`` (default: newest that verifies) of the run at ``uri`` to ``out``."""
    store = open_store(uri)
    try:
        if step is None:
            loaded, _skipped = load_newest(store, run_id=None)
            if loaded is None:
                raise StoreError(f"{uri} has no committed checkpoint that verifies; nothing to export")
        else:
            loaded = load_blobs(store, read_manifest(store, manifest_key(step)))
        weights = loaded.tensors.get("model")
        if is_sharded(loaded.manifest):  # an fsdp run's: its shards put together, in this one process
            weights = load_sharded_full(store, loaded.manifest)["model"]
    finally:
        store.close()
    spec = spec_from_dict(loaded.documents["spec"], source=f"spec stored in {uri}", check_files=False)
    tokenizer, model = model_mod.build(spec)
    model_mod.load_trainable_state(model, weights)
    os.makedirs(out, exist_ok=True)
    # safetensors saves through a 0600 temporary file: give what we write the mode the umask implies.
    before = FileTree.of(out)
    if spec.lora is None:
        model.save_pretrained(out)
    else:
        # With lm_head among the targets peft would also save the output layer itself; it is
        # frozen (never resized) and the base model has it, so the adapter holds LoRA weights only.
        model.save_pretrained(out, save_embedding_layers=False)
    # The tokenizer goes beside the weights (and the adapter), so AutoTokenizer
    # loads from the directory the model does, and adds BOS as training did.
    tokenizer = model_mod.with_leading_bos(tokenizer)
    tokenizer.save_pretrained(out)
    if spec.lora is not None and spec.model.name_or_path is None:
        base_dir = os.path.join(os.path.abspath(out), "base")
        base = model_mod.build_base_model(spec.model, tokenizer, spec.seed)
        base.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        cfg_path = os.path.join(out, "adapter_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["base_model_name_or_path"] = base_dir
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    before.apply_umask_to_written()
    return {"step": loaded.manifest.step, "out": out, "lora": spec.lora is not None}
