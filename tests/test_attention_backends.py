"""The attention-backend table is the one source of backend names, options and the auto rule.

Config validation, the DeepSpeed settings and the layer spec accept exactly the table's names and
refuse others with one message listing them; a backend's options reach its module as
``ModuleSpec`` params; every backend reads the layer's mask through one normalisation. No
processes: a core attention needs a ``TransformerConfig``, not Megatron's parallel state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.data import pack_attention_metadata
from megatron_wedlm.deepspeed_backend.settings import validate_deepspeed_run
from megatron_wedlm.model.attention import layer_mask
from megatron_wedlm.model.attention_backends import (
    ATTENTION_BACKEND_NAMES,
    ATTENTION_BACKENDS,
    get_attention_backend,
    resolve_attention_backend,
)
from megatron_wedlm.model.layer_spec import get_wedlm_layer_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"
UNKNOWN = "is not one of " + ", ".join(ATTENTION_BACKEND_NAMES)


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                             use_cpu_initialization=True)


def _core_attention(backend: str, **options):
    """The core attention a layer of ``backend`` builds, through the layer spec's ModuleSpec."""
    from megatron.core.transformer.enums import AttnMaskType

    spec = get_wedlm_layer_spec(backend, **options).submodules.self_attention.submodules.core_attention
    return spec(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.arbitrary, attention_type="self",
                cp_comm_type=None, softmax_scale=None, pg_collection=None)


def _row_metadata(seq_len: int = 32, block_size: int = 4):
    from megatron_wedlm.data import RowFormat, build_dual_stream_batch

    gen = torch.Generator().manual_seed(0)
    row = build_dual_stream_batch([torch.randint(1, 50, (seq_len // 2,), generator=gen)], RowFormat(block_size, 0),
                                  gen)
    return pack_attention_metadata(row.attention_metadata())


def test_config_accepts_exactly_the_table_names():
    assert ATTENTION_BACKEND_NAMES == ("auto", *ATTENTION_BACKENDS)
    for name in ATTENTION_BACKEND_NAMES:
        cfg = load_config(str(TINY), [f"model.attention_backend={name}", "trainer.device=auto"])
        assert cfg.model.attention_backend == name
    with pytest.raises(ConfigError, match=f"model.attention_backend='xformers' {UNKNOWN}"):
        load_config(str(TINY), ["model.attention_backend=xformers"])


def test_layer_spec_and_resolution_refuse_an_unknown_name_with_the_same_list():
    with pytest.raises(ValueError, match=f"attention_backend='xformers' {UNKNOWN}$"):
        get_wedlm_layer_spec("xformers")
    with pytest.raises(ValueError, match=f"attention_backend='xformers' {UNKNOWN}$"):
        resolve_attention_backend("xformers", torch.device("cpu"))
    with pytest.raises(ValueError, match="resolve_attention_backend"):
        get_wedlm_layer_spec("auto")  # a layer spec needs a resolved name


def test_auto_rule_and_cuda_requirement_come_from_the_table():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "dense"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "flex"
    for name, backend in ATTENTION_BACKENDS.items():
        assert resolve_attention_backend(name, torch.device("cuda")) == name
        if backend.needs_cuda:
            with pytest.raises(ValueError, match=f"{name}.*needs a CUDA device; on cpu use auto, dense, flex"):
                resolve_attention_backend(name, torch.device("cpu"))
            with pytest.raises(ConfigError, match=f"{name} needs a CUDA device, not trainer.device=cpu; use auto, dense, flex$"):
                load_config(str(TINY), [f"model.attention_backend={name}", "trainer.device=cpu"])


def test_deepspeed_accepts_the_names_with_an_hf_attention_implementation(tmp_path):
    (tmp_path / "hf").mkdir()

    def deepspeed_run(name: str):
        cfg = load_config(str(ROOT / "configs" / "sft" / "tiny_cpu_deepspeed.yaml"),
                          [f"model.attention_backend={name}", f"model.init_from={tmp_path / 'hf'}", "trainer.device=auto"])
        validate_deepspeed_run(cfg)

    for name in ATTENTION_BACKEND_NAMES:
        if name == "auto" or ATTENTION_BACKENDS[name].hf_attn_implementation is not None:
            deepspeed_run(name)
        else:
            with pytest.raises(ConfigError, match=f"'{name}' is not available .* use auto, dense, flex$"):
                deepspeed_run(name)


def test_context_parallelism_refuses_the_backends_the_table_marks():
    refused = [name for name, backend in ATTENTION_BACKENDS.items() if not backend.context_parallel]
    assert refused == ["te"]
    with pytest.raises(ConfigError, match="model.attention_backend=te .* use auto, dense, flex$"):
        load_config(str(TINY), ["parallelism.cp=2", "model.attention_backend=te"])


def test_module_spec_params_reach_the_module_and_change_its_tiles():
    from megatron_wedlm.model.attention import _MASK_CACHE, _dense_mask_and_plan

    default, tiled = _core_attention("dense"), _core_attention("dense", tile_size=8)
    assert default.tile_size == ATTENTION_BACKENDS["dense"].params["tile_size"] == 64
    assert tiled.tile_size == 8
    flex = _core_attention("flex", tile_size=16, compile_kernel=False)
    assert (flex.tile_size, flex.compile_kernel) == (16, False)

    packed = _row_metadata()
    q, k, v = (torch.randn(32, 1, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    _MASK_CACHE.clear()
    out_tiled = tiled(q, k, v, packed)
    _, plan = _dense_mask_and_plan(layer_mask(packed, q), q, tiled.tile_size)
    assert [t.end - t.start for t in plan] == [8] * 4  # the tile the spec set, not the default
    torch.testing.assert_close(out_tiled, default(q, k, v, packed), atol=1e-6, rtol=0)


def test_an_option_a_backend_does_not_take_is_refused_by_name():
    with pytest.raises(ValueError, match="backend 'dense' has no option compile_kernel; it takes tile_size"):
        get_wedlm_layer_spec("dense", compile_kernel=True)
    with pytest.raises(ValueError, match="backend 'te' has no option tile_size; it takes no options"):
        get_attention_backend("te").core_attention_spec(tile_size=8)


def test_the_config_reads_the_table_without_importing_torch_or_megatron():
    import subprocess

    probe = "import sys, megatron_wedlm.config; print(sorted({'torch', 'megatron'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_transformer_engine_is_not_imported_for_the_table_or_cpu_specs():
    for name in ("dense", "flex"):
        get_wedlm_layer_spec(name)
    get_attention_backend("te")
    assert "transformer_engine" not in sys.modules


def test_every_backend_reads_the_mask_through_one_normalisation():
    packed = _row_metadata()
    q = torch.randn(32, 1, 4, 8)
    assert layer_mask(packed, q).packed is packed
    dense = torch.ones(1, 1, 32, 32, dtype=torch.bool).triu(1)
    assert layer_mask(dense, q).masked_out is dense
    causal = layer_mask(None, q).packed
    assert causal.shape == (1, 3, 32) and bool(causal[:, 1].all())  # one document, memory stream only

    wrong = torch.zeros(1, 32, 32)  # a float mask is neither form
    messages = set()
    for module in (_core_attention("dense"), _core_attention("flex", compile_kernel=False)):
        with pytest.raises(ValueError) as err:
            module(q, q, q, wrong)
        messages.add(str(err.value))
    assert len(messages) == 1 and "expects packed metadata [B, 3, S]" in messages.pop()
