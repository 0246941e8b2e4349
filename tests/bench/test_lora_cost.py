"""bench/lora_cost.py's accounting of what a decode step's LoRA reads: `decode_adapter_bytes` against the LoRA
weights PEFT itself loads for the same adapters, and `ratio_ceiling` against the arithmetic written out. Nothing is
timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# loaded by path, as tests/bench/test_report.py loads report.py (bench/ holds modules named like common ones)
_spec = importlib.util.spec_from_file_location("bench_lora_cost", REPO / "bench" / "lora_cost.py")
lora_cost = importlib.util.module_from_spec(_spec)
sys.modules["bench_lora_cost"] = lora_cost
_spec.loader.exec_module(lora_cost)


def peft_lora_elements(base_dir: Path, adapter_dir: Path) -> int:
    """The lora_A and lora_B weights PEFT loads for the adapter, counted on its model."""
    from peft import PeftModel

    from lora_fixtures import hf_base_model

    model = PeftModel.from_pretrained(hf_base_model(base_dir), str(adapter_dir))
    return sum(p.numel() for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name)


def test_decode_adapter_bytes_counts_each_distinct_adapter_once_as_peft_loads_it(tiny_model_dir, tiny_adapters):
    peft = {name: peft_lora_elements(tiny_model_dir, path) for name, path in tiny_adapters.items()}
    assert len(set(peft.values())) == len(peft)  # the fixtures differ in rank and modules: a mix-up would show
    root = next(iter(tiny_adapters.values())).parent
    assert all(path.parent == root for path in tiny_adapters.values())
    for name, elements in peft.items():
        assert lora_cost.adapter_elements(root / name) == elements
    ids = ["qv-r8", None, "all-r4", "qv-r8", "all-r4", None]
    assert lora_cost.decode_adapter_bytes(ids, root, 2) == 2 * (peft["qv-r8"] + peft["all-r4"])
    assert lora_cost.decode_adapter_bytes(list(peft), root, 4) == 4 * sum(peft.values())
    assert lora_cost.decode_adapter_bytes([None, None], root, 2) == 0


def test_ratio_ceiling_adds_the_extra_reads_of_every_decode_step():
    # 63 decode steps reading 100 MB more each at 25 GB/s: 0.252 s on top of a 2 s round
    assert lora_cost.ratio_ceiling(2.0, 63, 100_000_000, 25e9) == pytest.approx(2.0 / 2.252)
    assert lora_cost.ratio_ceiling(1.5, 10, 0, 25e9) == 1.0
    assert lora_cost.ratio_ceiling(1.5, 10, -5_000_000, 25e9) == 1.0  # fewer bytes: no ceiling below 1
