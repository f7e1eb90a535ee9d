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

``--merge`` writes the adapters merged into the base instead, a plain model directory: in the base's frozen
dtype, or for a 4-bit base (Q-LoRA) into a copy dequantized to ``quantization.compute_dtype`` (bfloat16 by
default), see :func:`write_merged`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from elastic_ft.checkpoint.manifest import manifest_key
from elastic_ft.checkpoint.reader import load_blobs, load_newest, read_manifest
from elastic_ft.checkpoint.sharded import is_sharded, load_sharded_full
from elastic_ft.checkpoint.store import StoreError, open_store
from elastic_ft.config import ConfigError, JobSpec, QuantizationConfig, spec_from_dict
from elastic_ft.checkpoint.filemode import FileTree
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.train import model as model_mod
from elastic_ft.train import precision, quantization


def export(uri: str, out: str, *, step: int | None = None, merge: bool = False) -> dict:
    """Write the checkpoint at ``step`` (default: newest that verifies) of the run at ``uri`` to ``out``:
    the adapter (LoRA) or the model (full fine-tune), or with ``merge`` the adapters merged into the base
    (:func:`write_merged`; the result then says ``merged_dtype``)."""
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
    if merge and spec.lora is None:
        raise ConfigError([("lora", "is null (a full fine-tune): its export is a whole model already; drop --merge")],
                          source=f"spec stored in {uri}")
    os.makedirs(out, exist_ok=True)
    # safetensors saves through a 0600 temporary file: give what we write the mode the umask implies.
    before = FileTree.of(out)
    if merge:
        dtype = write_merged(spec, weights, out)
        before.apply_umask_to_written()
        return {"step": loaded.manifest.step, "out": out, "lora": False, "merged_dtype": str(dtype).split(".")[-1]}
    # The adapter's tensors and names are the same on a 4-bit base and on the unquantized one: build the
    # latter, so that exporting needs no bitsandbytes (nor the quantization's time).
    tokenizer, model = model_mod.build(dataclasses.replace(spec, quantization=QuantizationConfig()))
    model_mod.load_trainable_state(model, weights)
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


def merged_dtype(spec: JobSpec) -> torch.dtype:
    """The dtype of a merged export: the base's frozen dtype, or for a 4-bit base ``quantization.compute_dtype``,
    the dtype its weights were dequantized to for every matmul of training (a float32 copy would be 4 times
    the 4-bit bytes and no closer to what was trained; bfloat16 is what Q-LoRA merges usually ship in)."""
    if spec.quantization.load_in_4bit:
        return getattr(torch, spec.quantization.compute_dtype)
    return precision.load_dtype(spec.model.dtype, spec.precision)


def write_merged(spec: JobSpec, weights: dict[str, torch.Tensor], out: str) -> torch.dtype:
    """The adapters of ``weights`` merged into the base, written to ``out`` as a plain model directory that
    ``AutoModelForCausalLM.from_pretrained`` loads (with the tokenizer); returns its dtype.

    A 4-bit base is quantized as training quantized it (the same bytes), then dequantized into a copy in
    :func:`merged_dtype`: the merge adds the adapters to the weights training used, not to the unquantized
    originals (which would shift every adapted layer by the quantization error). Costs the base whole in
    that dtype in host memory (16 GB for an 8B model in bfloat16).
    """
    dtype = merged_dtype(spec)
    with InputSource.from_spec(spec) as inputs:  # an s3:// model: this machine's cached copy
        cfg = inputs.model(spec.model)
        tokenizer = model_mod.build_tokenizer(cfg)
        base = model_mod.build_base(cfg, tokenizer, spec.seed, spec.precision, None, spec.quantization)
    if spec.quantization.load_in_4bit:
        base = quantization.dequantize(base, dtype)
    model = model_mod.apply_lora(base, spec)
    model_mod.load_trainable_state(model, weights)
    merged = model.merge_and_unload().to(dtype)
    merged.save_pretrained(out)
    model_mod.with_leading_bos(tokenizer).save_pretrained(out)
    return dtype
