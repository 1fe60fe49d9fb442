"""plan_layout.py: searches layouts with the step model and writes a system YAML the harness accepts."""

import pytest

from harness.system_config import load_system_config
from scripts.plan_layout import main


@pytest.mark.slow
def test_planner_writes_a_valid_system_config_with_its_prediction(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    main(["--hardware", "h200", "--gpus", "2", "--scenario", "interactive", "--model", "qwen3-vl-30b-a3b",
          "--tp", "1,2", "--layouts", "aggregated,pd-1:1", "--policies", "least_loaded", "--requests", "60",
          "--max-num-seqs", "256", "--out", str(out)])
    text = out.read_text()
    assert "# Predicted (step model, virtual clock):" in text
    config = load_system_config(out)
    assert config.model.simulated_hardware == "h200"
    assert config.workers.num_gpus == 2
    assert config.scenarios.interactive.target_latency_ms == 1500
    assert config.scenarios.interactive.target_qps > 0


def test_planner_can_write_a_real_checkpoint_config(tmp_path):
    out = tmp_path / "plan.yaml"
    main(["--hardware", "h200", "--gpus", "1", "--scenario", "offline", "--model", "qwen3-vl-30b-a3b", "--tp", "1",
          "--layouts", "aggregated", "--policies", "round_robin", "--requests", "32", "--max-num-seqs", "256",
          "--checkpoint", "/models/Qwen3-VL-30B-A3B-Instruct", "--out", str(out)])
    config = load_system_config(out)
    assert config.model.checkpoint == "/models/Qwen3-VL-30B-A3B-Instruct" and not config.simulation
    assert config.engine["device"] == "cuda"
