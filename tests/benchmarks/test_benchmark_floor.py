"""CPU tests of the decode benchmark's floor byte model (benchmarks/harness/shapes.py): the bytes
a decode step must read per shape, the GPU memory it needs, the floor in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import machine, sweep
from benchmarks.harness.shapes import (
    ModelShape,
    decode_step_bytes,
    floor_ms,
    prepare_config_dir,
    read_config,
    resident_weight_bytes,
    shipped_config_dir,
)
from tests.benchmarks.harness_util import _shape


def test_floor_bytes_qwen3_0_6b() -> None:
    # Hand check, b1 c512. Per layer: q 1024*2048 + k,v 2*1024*1024 + o 2048*1024 = 6,291,456;
    # norms 2*128 + 2*1024 = 2,304; MLP 3*1024*3072 = 9,437,184 -> 15,730,944 * 28 layers
    # = 440,466,432; + final norm 1,024 + LM head 151,936*1,024 = 155,582,464 + 1 embedding row
    # 1,024 = 596,050,944 params * 2 bytes = 1,192,101,888. KV: 28*2*8*128*2 = 114,688 B/token
    # * 512 = 58,720,256.
    step = decode_step_bytes(_shape("qwen3-0.6b"), 1, 512)
    assert step.weights == 1_192_101_888
    assert step.kv == 58_720_256
    assert step.total == 1_250_822_144
    assert step.experts_touched == 0
    assert decode_step_bytes(_shape("qwen3-0.6b"), 64, 4096).kv == 64 * 4096 * 114_688


def test_floor_bytes_qwen3_8b() -> None:
    shape = _shape("qwen3-8b")
    assert shape.kv_bytes_per_token() == 36 * 2 * 8 * 128 * 2
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 2 * 128 + 2 * 4096 + 3 * 4096 * 12288
    params = 36 * per_layer + 4096 + 151936 * 4096 + 4096
    assert decode_step_bytes(shape, 1, 0).weights == 2 * params == 15_136_819_200


def test_floor_bytes_qwen3_30b_a3b_counts_touchable_experts() -> None:
    shape = _shape("qwen3-30b-a3b")
    # b1: top-8 of 128 experts. Per layer: attention 18,874,368 + norms 4,352 + router 262,144
    # + 8 experts * 3*2048*768 = 37,748,736 -> 56,889,600 * 48 = 2,730,700,800; + 2,048 + LM head
    # 311,164,928 + 2,048 = 3,041,869,824 params (the "A3B") -> 6,083,739,648 bytes.
    b1 = decode_step_bytes(shape, 1, 512)
    assert b1.experts_touched == 8
    assert b1.weights == 6_083_739_648
    assert b1.kv == 512 * 48 * 2 * 4 * 128 * 2
    expert = 3 * 2048 * 768 * 2 * 48  # bytes of one expert slot over all layers
    b8 = decode_step_bytes(shape, 8, 512)
    assert b8.experts_touched == 64
    assert b8.weights - b1.weights == 56 * expert + 7 * 2048 * 2
    b32, b64 = decode_step_bytes(shape, 32, 512), decode_step_bytes(shape, 64, 512)
    assert b32.experts_touched == b64.experts_touched == 128  # saturated: every expert is read
    assert b64.weights - b32.weights == 32 * 2048 * 2  # only embedding rows differ


def test_interleave_refuses_engines_the_gpu_cannot_hold() -> None:
    """Qwen3-30B-A3B holds 30.5B parameters (every expert, embedding and LM head apart): two
    engines fit a 140 GiB H200 under --interleave, three do not, and an 80 GiB H100 holds one;
    the refusal quotes the sizes and names the fix."""
    shape = _shape("qwen3-30b-a3b")
    per_layer = 18_874_368 + 4_352 + 262_144 + 128 * 3 * 2048 * 768
    assert resident_weight_bytes(shape) == 2 * (per_layer * 48 + 2048 + 2 * 151_936 * 2048)
    kv, h200, h100 = 15 * 2**29, 143_771 * 2**20, 81_559 * 2**20
    assert sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 2, h200) is None
    why = sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 3, h200)
    assert why is not None and "3 engines of qwen3-30b-a3b" in why and "at most 2 mode" in why
    assert "weights 56.9" in why and "--num-layers" in why
    assert "at most 1 mode" in (sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 2, h100)
                                or "")
    assert sweep.interleave_overflow("qwen3-0.6b", _shape("qwen3-0.6b"), kv, 6, h100) is None


def test_gpu_memory_read_from_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    """The interleave check's GPU size comes from nvidia-smi's MiB; a failing or absent
    nvidia-smi gives None (the check is then skipped), never an exception."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "-L" ] && exit 1\necho 143771\necho 143771\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.gpu_memory_bytes() == 143_771 * 2**20
    assert machine.nvidia_smi("-L") is None
    smi.write_text("#!/bin/sh\necho 'not a number'\n")
    assert machine.gpu_memory_bytes() is None
    monkeypatch.setenv("PATH", str(tmp_path / "absent"))
    assert machine.gpu_memory_bytes() is None


def test_floor_ms_and_layer_override(tmp_path: Path) -> None:
    assert floor_ms(4_300_000_000, 4300.0) == pytest.approx(1.0)
    assert floor_ms(1, None) is None
    config_dir, layers = prepare_config_dir("qwen3-30b-a3b", 12, tmp_path)
    assert layers == 12 and read_config(config_dir)["num_hidden_layers"] == 12
    full, cut = _shape("qwen3-30b-a3b"), ModelShape.from_config(read_config(config_dir))
    assert cut.num_layers == 12 and full.num_layers == 48
    assert decode_step_bytes(cut, 1, 100).kv * 4 == decode_step_bytes(full, 1, 100).kv
    with pytest.raises(ValueError, match="expected 1..48"):
        prepare_config_dir("qwen3-30b-a3b", 49, tmp_path)
    assert prepare_config_dir("qwen3-8b", None, tmp_path) == (shipped_config_dir("qwen3-8b"), 36)


def test_floor_bytes_of_an_fp8_shape(tmp_path: Path) -> None:
    """Block FP8: the projections and experts at one byte a weight (the block scales, 1/16384
    of them, left out), embeddings, norms, router and LM head still bf16; -kv8: a 1-byte KV."""
    bf16 = _shape("qwen3-30b-a3b")
    config_dir, _ = prepare_config_dir("qwen3-30b-a3b-fp8-kv8", None, tmp_path)
    fp8 = ModelShape.from_config(read_config(config_dir), fp8_kv=True)
    assert (fp8.linear_bytes, fp8.kv_dtype_bytes) == (1, 1)
    assert fp8.kv_bytes_per_token() * 2 == bf16.kv_bytes_per_token()
    b1, b1_fp8 = decode_step_bytes(bf16, 1, 512), decode_step_bytes(fp8, 1, 512)
    linear = 48 * (18_874_368 + 8 * 3 * 2048 * 768)  # attention + 8 experts, per the hand check
    assert b1.weights - b1_fp8.weights == linear  # one byte less for each of them
    assert b1_fp8.kv * 2 == b1.kv
