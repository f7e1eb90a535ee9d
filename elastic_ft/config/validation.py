"""Range and consistency rules of the job spec that types alone cannot express."""

from __future__ import annotations

import importlib.util
import os

from elastic_ft.config.bounds import out_of_range, show_value as _show
from elastic_ft.config.limits import LIMITS
from elastic_ft.config.sections import JobSpec
from elastic_ft.inputs.uri import has_scheme, uri_problem
from elastic_ft.config.names import name_problem


TENSORBOARD_EXTRA = "pip install 'elastic-ft[tensorboard]'"
QLORA_EXTRA = "pip install 'elastic-ft[qlora]'"


def tensorboard_missing() -> str | None:
    """Why ``logging.tensorboard: true`` cannot work here (its package is not installed), or None.

    Here, not in :mod:`elastic_ft.viz.tensorboard`: the spec is checked below the layer that writes the events.
    """
    if importlib.util.find_spec("tensorboard") is None:
        return f"needs the tensorboard package, which is not installed: {TENSORBOARD_EXTRA}"
    return None


def bitsandbytes_missing() -> str | None:
    """Why ``quantization.load_in_4bit: true`` cannot work here (bitsandbytes is not installed), or None."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"needs the bitsandbytes package, which is not installed: {QLORA_EXTRA}"
    return None


def _lora_problems(spec: JobSpec, check_files: bool) -> list[tuple[str, str]]:
    """The LoRA options and the 4-bit base against each other and the rest of the spec."""
    p: list[tuple[str, str]] = []
    lora, q = spec.lora, spec.quantization
    if lora is not None:
        if lora.init_lora_weights == "orthogonal" and lora.r % 2:
            p.append(("lora.init_lora_weights", f"orthogonal needs an even lora.r, got {lora.r}"))
        if lora.modules_to_save is not None and not lora.modules_to_save:
            p.append(("lora.modules_to_save", "is an empty list; name at least one module, or remove it"))
    if not q.load_in_4bit:
        return p
    if lora is None:
        p.append(("quantization.load_in_4bit", "needs a lora section: 4-bit weights are frozen, a full fine-tune "
                                               "cannot train them; add lora, or set load_in_4bit: false"))
    elif lora.init_lora_weights == "orthogonal":
        p.append(("lora.init_lora_weights", "orthogonal cannot start adapters on a 4-bit base "
                                            "(quantization.load_in_4bit: PEFT gives them the base weight's integer "
                                            "dtype); use true or gaussian"))
    if spec.precision.param_dtype == "float16":
        # Measured: bitsandbytes returns its output in its input's dtype, float16 here, which the bfloat16
        # autocast that float16 weights require then refuses to mix ("Unexpected floating ScalarType").
        p.append(("precision.param_dtype", "float16 does not train with a 4-bit base (quantization.load_in_4bit: "
                                           "true): its float16 activations meet bfloat16 autocast; use bfloat16"))
    if spec.model.dtype != "float32":
        p.append(("model.dtype", f"casts the whole model, 4-bit weights included "
                                 f"(quantization.load_in_4bit: true); remove it and set precision.param_dtype: "
                                 f"{spec.model.dtype} for the weights that are not quantized"))
    if check_files:  # the machine that trains needs the package, not one that only validates or exports
        if (missing := bitsandbytes_missing()) is not None:
            p.append(("quantization.load_in_4bit", missing))
    return p


def validate(spec: JobSpec, *, check_files: bool = True) -> list[tuple[str, str]]:
    """Range and consistency checks that types alone cannot express."""
    p: list[tuple[str, str]] = []

    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            p.append((field, msg))

    m, d, o, b = spec.model, spec.data, spec.optimizer, spec.batch
    need(bool(m.name_or_path) != bool(m.config), "model",
         "set exactly one of model.name_or_path and model.config")
    if m.config is not None:
        need("model_type" in m.config, "model.config.model_type", "is required (e.g. llama)")
    need(bool(d.files) != bool(d.dataset), "data", "set exactly one of data.files and data.dataset")
    need((d.prompt_field is None) == (d.response_field is None), "data.response_field",
         "prompt_field and response_field must be set together")
    if d.messages_field is not None:
        # text_field has a default: only a changed one is a second kind of sample.
        others = [f"data.{name}" for name, value in (("text_field", d.text_field != "text"),
                                                     ("prompt_field", d.prompt_field is not None),
                                                     ("response_field", d.response_field is not None)) if value]
        need(not others, "data.messages_field",
             f"chat data cannot be combined with {' and '.join(others)}; set either messages_field or those")
        need(bool(d.messages_field), "data.messages_field", "must name a field of the records, got ''")
    if spec.lora is not None:
        need(bool(spec.lora.target_modules), "lora.target_modules", "must name at least one module")
    need(len(o.betas) == 2, "optimizer.betas", f"must be two numbers, got {_show(o.betas)}")
    if b.policy == "scale_with_world" and b.global_batch > 0 and b.reference_world > 0:
        need(b.global_batch % b.reference_world == 0, "batch.global_batch",
             f"must be a multiple of batch.reference_world ({b.reference_world}) for scale_with_world, "
             f"got {b.global_batch}")
    need((spec.steps is None) != (spec.epochs is None), "steps", "set exactly one of steps and epochs")
    problem = name_problem(spec.name) if check_files else None
    need(problem is None, "name", f"{problem} (it is the default run id)")
    need(spec.logging.dir is None or _only_run_id_placeholder(spec.logging.dir), "logging.dir",
         f"may use only the placeholder {{run_id}}, got {_show(spec.logging.dir)}")
    if spec.logging.tensorboard and check_files:  # the machine that trains needs the package, not an exporter
        need((missing := tensorboard_missing()) is None, "logging.tensorboard", str(missing))
    pr = spec.precision
    need(m.dtype == "float32" or pr == type(pr)(), "model.dtype",
         f"casts the whole model and cannot be combined with the precision section; remove model.dtype and "
         f"set precision.param_dtype: {m.dtype} (trainable weights then stay float32)")
    need(pr.param_dtype == "float32" or pr.compute != "float32", "precision.compute",
         f"must be bfloat16 when precision.param_dtype is {pr.param_dtype} (float32 matmuls cannot take "
         f"{pr.param_dtype} weights)")
    par = spec.parallelism
    need(par.shard_size is None or par.strategy == "fsdp", "parallelism.shard_size",
         f"applies to parallelism.strategy fsdp only (it is {par.strategy}); remove it or set the strategy to fsdp")
    p.extend(_eval_problems(spec))
    p.extend(_lora_problems(spec, check_files))
    p.extend(out_of_range(spec, LIMITS))
    reported = {field for field, _ in p}
    # The store's own rules (threshold >= part size, the SSE pair): checked again, with the
    # environment's values, when the store opens; here before any work, naming the field.
    p.extend((f"checkpoint.s3.{field}", msg) for field, msg in spec.checkpoint.s3.problems()
             if f"checkpoint.s3.{field}" not in reported)
    p.extend(_input_problems(spec, check_files))
    return p


def _eval_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Held-out data, its cadence and keep_best: each problem naming the field to change."""
    d, ev, c = spec.data, spec.eval, spec.checkpoint
    p = []
    if d.eval_files and d.eval_fraction is not None:
        p.append(("data.eval_fraction", "cannot be combined with data.eval_files; set one of them"))
    if d.eval_files and d.dataset:
        p.append(("data.eval_files", "applies to data.files; with data.dataset use data.eval_fraction"))
    held_out = bool(d.eval_files) or d.eval_fraction is not None
    if ev.every_steps is not None and not held_out:
        p.append(("eval.every_steps", "needs held-out data: set data.eval_files or data.eval_fraction"))
    if held_out and ev.every_steps is None:
        p.append(("eval.every_steps", "must be set when data.eval_files or data.eval_fraction is (how often "
                                      "to evaluate)"))
    if c.keep_best:
        if ev.every_steps is None:
            p.append(("checkpoint.keep_best", "needs evaluation: set eval.every_steps and held-out data"))
        elif c.every_steps == "auto":
            p.append(("checkpoint.keep_best", "needs checkpoints at evaluated steps, which checkpoint.every_steps: "
                                              "auto does not keep to; set every_steps to a multiple of "
                                              f"eval.every_steps ({ev.every_steps})"))
        elif c.every_steps is None or c.every_steps % ev.every_steps:
            p.append(("checkpoint.keep_best", f"needs checkpoints at evaluated steps: checkpoint.every_steps "
                                              f"({c.every_steps}) must be a multiple of eval.every_steps "
                                              f"({ev.every_steps})"))
    return p


def _input_problems(spec: JobSpec, check_files: bool) -> list[tuple[str, str]]:
    """A URI that cannot be fetched (any scheme but s3://, a malformed s3:// URI), or a local data file missing."""
    p = []
    for field in ("name_or_path", "tokenizer"):
        value = getattr(spec.model, field)
        if value is not None and (problem := uri_problem(value, directory=True)):
            p.append((f"model.{field}", problem))
    for field in ("files", "eval_files"):
        for i, f in enumerate(getattr(spec.data, field)):
            if has_scheme(f):
                if problem := uri_problem(f, directory=False):
                    p.append((f"data.{field}[{i}]", problem))
            elif check_files and not os.path.isfile(f) and "://" not in f:
                p.append((f"data.{field}[{i}]", f"file {f!r} does not exist"))
    return p


def _only_run_id_placeholder(template: str) -> bool:
    # logging.dir is str.format-ed with run_id: any other {field} would raise at start-up.
    try:
        template.format(run_id="x")
    except (KeyError, IndexError, ValueError, AttributeError):
        return False
    return True
