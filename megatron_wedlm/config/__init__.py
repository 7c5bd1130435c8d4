"""Training configuration: typed schema (:mod:`.schema`) + YAML/CLI loading (:mod:`.loading`); the
checks that read the data it names (:mod:`.data_check`)."""

from .data_check import check_data_files
from .loading import config_from_yaml_text, config_to_yaml, load_config, save_config
from .schema import (
    CheckpointingConfig,
    ConfigError,
    BlendSourceConfig,
    DataConfig,
    DeepSpeedConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainConfig,
    TrainerConfig,
    WandbConfig,
    WeDLMConfig,
    validate_config,
    validate_layout,
)

__all__ = [
    "CheckpointingConfig",
    "ConfigError",
    "BlendSourceConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeDLMConfig",
    "check_data_files",
    "config_from_yaml_text",
    "config_to_yaml",
    "load_config",
    "save_config",
    "validate_config",
    "validate_layout",
]
