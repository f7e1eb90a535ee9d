"""Job spec: the YAML file that describes a run, mapped onto dataclasses.

Loading is strict: every unknown key, wrong type and out-of-range value is
collected and reported together in one :class:`ConfigError`, each problem
naming its dotted field path and the bad value, and unknown keys suggest the
closest valid name. Command-line overrides (``optimizer.lr=3e-4``) are applied
to the raw mapping before validation so they are checked the same way.

Modules: ``sections`` (the dataclasses, one per section of the spec),
``limits`` (the bound of every numeric field), ``loading`` (YAML, overrides,
:class:`ConfigError`) and ``validation`` (rules across fields). Import from
here: the names below are the package's interface.
"""

from elastic_ft.config.limits import LIMITS, MAX_BATCH, MAX_STEPS
from elastic_ft.config.loading import ConfigError, apply_overrides, load_spec, spec_from_dict
from elastic_ft.config.sections import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    InputsConfig,
    JobSpec,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    QuantizationConfig,
    SpotConfig,
)
from elastic_ft.config.validation import validate

__all__ = [
    "LIMITS", "MAX_BATCH", "MAX_STEPS", "BatchConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "InputsConfig",
    "JobSpec", "LoggingConfig", "LoraConfig", "ModelConfig", "OptimizerConfig", "ParallelismConfig", "PrecisionConfig",
    "QuantizationConfig", "SpotConfig", "apply_overrides",
    "load_spec", "spec_from_dict", "validate",
]
