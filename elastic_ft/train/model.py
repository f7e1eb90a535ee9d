"""The model and tokenizer: from a local directory, a hub name or an ``s3://``
prefix (fetched into the node's input cache first, :mod:`elastic_ft.inputs`),
or built from an inline config (tiny test models), then wrapped with LoRA by peft.

No weights are downloaded for the default job: an inline config is initialised
from the spec's seed, and its tokenizer is a byte-level one built in code, so
the same spec gives the same base model on every machine, and export can
rebuild the base model from the spec alone.
"""

from __future__ import annotations

import os

import torch

from elastic_ft.config import ConfigError, JobSpec, ModelConfig, PrecisionConfig, QuantizationConfig
from elastic_ft.inputs.resolve import InputSource
from elastic_ft.train import loss, precision
from elastic_ft.train.quantization import bnb_config, device_problem, is_4bit, keep_one_layout

_SPECIALS = ("<pad>", "<s>", "</s>")

BYTE_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
"""The byte tokenizer's chat template (Zephyr's shape): BOS, then each turn as a ``<|role|>`` line and its
content closed by EOS. An assistant turn's content and EOS are in a ``{% generation %}`` block: what chat data
trains (:mod:`elastic_ft.train.chat`); its header is not. No text between turns, so the spans found by
rendering prefixes are the same."""


def byte_tokenizer():
    """A byte-level tokenizer: 256 byte tokens + pad/bos/eos, no training, no download, and a small chat
    template (:data:`BYTE_CHAT_TEMPLATE`) for chat data.

    Called as usual (``add_special_tokens`` true) it puts BOS first, as
    :func:`elastic_ft.train.data.tokenize` does for every training sample, so
    the saved tokenizer prompts an exported model as it was trained.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = BYTE_CHAT_TEMPLATE
    return with_leading_bos(fast)


def with_leading_bos(tokenizer):
    """``tokenizer``, made to put BOS first when called with special tokens, as training does.

    Training prepends BOS itself (``add_special_tokens=False`` plus the id), so
    a model learns to read prompts after BOS; a tokenizer that does not add it
    (the byte tokenizer, GPT-2's) would prompt the exported model differently.
    Fast tokenizers get a BOS template; one that adds BOS already is unchanged.
    """
    bos = tokenizer.bos_token
    if bos is None or not tokenizer.is_fast or tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        return tokenizer
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)],
    )
    return tokenizer


def build_tokenizer(cfg: ModelConfig):
    source = cfg.tokenizer or cfg.name_or_path
    if source is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def pretrained_kwargs(dtype: torch.dtype, device: torch.device | None) -> dict:
    """``from_pretrained``'s loading options: weights read in ``dtype`` straight onto ``device``.

    The model is built on the meta device and each tensor of the checkpoint (memory-mapped safetensors) is
    converted and placed as it is read: one copy of the weights per rank, on its device, never a float32
    one first. transformers 5 always builds on meta; a device map makes it (and 4.x, where it implies
    ``low_cpu_mem_usage``) place each weight on the device instead of in host memory. One device for the
    whole model: no accelerate dispatch hooks. Never hub kernels: transformers 5.25 turned ``use_kernels``
    on by default, which fetches layer kernels from the Hugging Face Hub while loading (a training node
    must not need the hub, and those kernels refuse the meta device).
    """
    kwargs: dict = {"dtype": dtype, "use_kernels": False}
    if device is not None:
        kwargs["device_map"] = {"": str(device)}
    return kwargs


def build_base_model(cfg: ModelConfig, tokenizer, seed: int, dtype: torch.dtype | None = None,
                     device: torch.device | None = None):
    """The base causal LM in ``dtype`` (default: ``model.dtype``), deterministic for an inline config and ``seed``.

    A pretrained one is loaded onto ``device`` (default: host memory); an inline one is built in host
    memory, so that its seeded weights are the same on every machine (the caller moves it).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or getattr(torch, cfg.dtype)
    if cfg.name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **pretrained_kwargs(dtype, device))
    inline = dict(cfg.config or {})
    model_type = inline.pop("model_type")
    inline.setdefault("vocab_size", len(tokenizer))
    for name in ("pad", "bos", "eos"):
        inline.setdefault(f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
    config = AutoConfig.for_model(model_type, **inline)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)




def build_quantized_base(cfg: ModelConfig, tokenizer, seed: int, policy: PrecisionConfig, q: QuantizationConfig,
                         device: torch.device | None = None, sharded: bool = False):
    """The base with its decoder-layer Linear weights in 4 bits (``Linear4bit``), quantized onto ``device``
    (default: host memory) as transformers loads them; what is not quantized in ``policy``'s frozen dtype.
    ``sharded``: the packed weights stored as FSDP shards them (:func:`quantization.bnb_config`); the
    same bytes either way. Each module keeps its layout (:func:`quantization.keep_one_layout`).

    Deterministic: blockwise 4-bit quantization is a pure function of the weights, so the same base gives
    the same bytes in every process, and a restarted worker trains on exactly what its predecessor did.
    An inline config's seeded float32 weights go through a temporary directory, the very path a
    pretrained one takes (transformers quantizes while it loads; it has no in-place entry point): the
    temporary costs one float32 write of the model to the host's disk, per (re)start, for a test-size model.
    Cost: one pass over the base's weights, growing with the model, not the data or the node count.
    """
    from transformers import AutoModelForCausalLM

    device = device or torch.device("cpu")
    if (problem := device_problem(q, device.type, precision.bf16_supported(device))) is not None:
        raise ConfigError([problem])
    kwargs = pretrained_kwargs(precision.load_dtype(cfg.dtype, policy), device)
    kwargs["quantization_config"] = bnb_config(q, sharded)
    if cfg.name_or_path is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
        keep_one_layout(model)
        return model
    import tempfile

    from safetensors.torch import save_model

    full = build_base_model(cfg, tokenizer, seed, torch.float32)
    with tempfile.TemporaryDirectory(prefix="elastic-ft-base-") as tmp:
        # Not full.save_pretrained: under torch.distributed it writes on rank 0 only, and every rank
        # quantizes its own copy. save_model keeps one of each tied tensor, as save_pretrained does.
        full.config.save_pretrained(tmp)
        save_model(full, os.path.join(tmp, "model.safetensors"))
        del full
        model = AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
    keep_one_layout(model)
    return model


def build_base(cfg: ModelConfig, tokenizer, seed: int, policy: PrecisionConfig, device: torch.device | None = None,
               quantization: QuantizationConfig | None = None, sharded: bool = False):
    """The base model for ``policy``: a pretrained one loaded straight in its frozen dtype onto ``device``
    (an 8B model never sits in host memory, nor anywhere as float32); an inline one built in float32, as
    its weights are drawn, and its parameters cast by :func:`precision.apply` (not its buffers: rotary
    frequencies stay float32). With ``quantization.load_in_4bit``: :func:`build_quantized_base` (``sharded``:
    for FSDP)."""
    if quantization is not None and quantization.load_in_4bit:
        return build_quantized_base(cfg, tokenizer, seed, policy, quantization, device, sharded)
    if cfg.name_or_path is not None or precision.is_default(policy):
        return build_base_model(cfg, tokenizer, seed, precision.load_dtype(cfg.dtype, policy), device)
    return build_base_model(cfg, tokenizer, seed, torch.float32)


def unmatched_targets(module_names: list[str], targets: list[str]) -> list[str]:
    """The ``targets`` that match no module name, by peft's rule for a list.

    peft adapts a module whose full name equals an entry or ends with "." + the
    entry; it raises only when *no* entry matches, and silently skips the
    others, so a typo in one entry would train without that adapter.
    """
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in module_names)]


def adaptable_names(model) -> list[str]:
    """Distinct leaf names of the modules LoRA usually adapts (Linear, GPT-2's Conv1D): what to suggest."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if name and type(module).__name__ in ("Linear", "Conv1D")}
    return sorted(names)


def check_target_modules(model, targets: list[str], field: str = "lora.target_modules") -> None:
    """Raise :class:`ConfigError` naming each ``field`` entry that matches no module."""
    missing = unmatched_targets([name for name, _ in model.named_modules()], targets)
    if missing:
        names = " and ".join(map(repr, missing))
        verb = "matches" if len(missing) == 1 else "match"
        known = ", ".join(adaptable_names(model)) or "(none)"
        raise ConfigError([(field, f"{names} {verb} no module of the model; "
                                   f"its Linear/Conv1D modules are named: {known}")])




def check_modules_to_save(model, names: list[str]) -> None:
    """Raise :class:`ConfigError` naming ``lora.modules_to_save`` when an entry matches no module, or a
    4-bit one (its packed weights cannot be trained in full)."""
    check_target_modules(model, names, "lora.modules_to_save")
    quantized = sorted({t for t in names for n, m in model.named_modules()
                        if (n == t or n.endswith("." + t)) and is_4bit(m)})
    if quantized:
        raise ConfigError([("lora.modules_to_save", f"{', '.join(map(repr, quantized))} is 4-bit "
                                                    f"(quantization.load_in_4bit): it cannot be trained in full; "
                                                    f"name unquantized modules (embed_tokens, lm_head)")])


def peft_config(spec: JobSpec):
    """PEFT's ``LoraConfig`` for the spec's ``lora`` section (every option reaches ``adapter_config.json``)."""
    from peft import LoraConfig

    lora = spec.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type="CAUSAL_LM",
        use_dora=lora.use_dora, use_rslora=lora.use_rslora, init_lora_weights=lora.init_lora_weights,
        modules_to_save=None if lora.modules_to_save is None else list(lora.modules_to_save),
    )


def apply_lora(model, spec: JobSpec):
    """Wrap ``model`` with LoRA adapters (or leave it whole for a full fine-tune).

    On a 4-bit base, PEFT's ``prepare_model_for_kbit_training`` is not called: what it does that
    matters is done here already (the base frozen by PEFT, the checkpointing of
    :func:`enable_gradient_checkpointing`, non-reentrant so no input hook is needed), and what it adds
    costs memory: it casts every unquantized weight (embeddings, output layer, norms) to float32,
    2.1 GB more for Llama-3.1-8B's bfloat16 embeddings and output layer (measured on the tiny and ~100M
    models by bench/qlora.py). Trainable weights are float32 here in any case (below).
    """
    if spec.lora is None:
        return model
    from peft import get_peft_model

    if not isinstance(spec.lora.target_modules, str):  # all-linear is PEFT's to resolve
        check_target_modules(model, list(spec.lora.target_modules))
    if spec.lora.modules_to_save:
        check_modules_to_save(model, list(spec.lora.modules_to_save))
    lora = peft_config(spec)
    with torch.random.fork_rng(devices=[]):
        # LoRA A matrices are random: seed them so every rank and every restart
        # starts from the same adapter (the checkpoint overwrites them on resume).
        torch.manual_seed(spec.seed + 1)
        model = get_peft_model(model, lora)
    if not spec.quantization.load_in_4bit:
        return model  # precision.apply decides (a legacy model.dtype casts the adapters too)
    # On a 4-bit base PEFT may give adapters the compute dtype: they train in float32, as for LoRA.
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    return model


def build(spec: JobSpec, inputs: InputSource | None = None, device: torch.device | None = None):
    """(tokenizer, model ready to train) for ``spec``; ``s3://`` directories come through ``inputs``
    (default: a source of the spec's own settings, closed after). A pretrained model's weights are loaded
    onto ``device`` (an inline one's are the caller's to move: they are built on the host)."""
    if inputs is None:
        with InputSource.from_spec(spec) as own:
            return build(spec, own, device)
    cfg = inputs.model(spec.model)
    tokenizer = build_tokenizer(cfg)
    base = build_base(cfg, tokenizer, spec.seed, spec.precision, device, spec.quantization,
                      sharded=spec.parallelism.strategy == "fsdp")
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    model = apply_lora(base, spec)
    loss.check_model(model, cfg.loss_chunk_tokens)
    precision.apply(model, spec.precision)
    # from_pretrained returns a model in eval mode: dropout off, and transformers recomputes
    # checkpointed layers only in training mode.
    model.train()
    return tokenizer, model


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass (torch's non-reentrant checkpoint).

    Non-reentrant: LoRA weights inside a checkpointed layer get their gradients although the
    layer's input comes from a frozen embedding (transformers also hooks the embedding's
    output to require grad, as peft's ``enable_input_require_grads`` does). Dropout masks
    are replayed from the saved RNG state, so the loss is unchanged. The KV cache is off:
    it would keep what checkpointing frees.
    """
    if not model.supports_gradient_checkpointing:
        raise ConfigError([("model.gradient_checkpointing", f"{type(model).__name__} does not support it; "
                                                            f"set it to false")])
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters being trained, by name: LoRA weights, or everything for a full fine-tune."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def check_trainable_names(model, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` names exactly the model's trainable parameters (a foreign checkpoint)."""
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint weights do not match this model: {len(missing)} missing (e.g. {sorted(missing)[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]}); was it written with another "
            f"model or LoRA config?"
        )


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable weights back in; names must match exactly (a foreign checkpoint fails here)."""
    check_trainable_names(model, state)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)



