"""Without the optional extras: no rich (the ``cli`` extra), no matplotlib (the ``plots`` extra), no Ray (``ray``).

Each check runs in a child interpreter that sees neither the module nor the metadata of the hidden distribution
(:func:`tests.without.run_without`), as where it was never installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lightning_cannikin.tools.cli import main as cli_main
from lightning_cannikin.tools.report import PLOTS_INSTALL, plot_or_skip
from tests.test_packaging import _profile as write_profile
from tests.test_packaging import _pyproject, _requirement_names
from tests.without import run_without

NO_MATPLOTLIB = {"matplotlib", "mpl-toolkits", "pylab"}


def test_rich_is_an_extra_not_a_dependency():
    project = _pyproject()["project"]
    assert "rich" not in _requirement_names(project["dependencies"])
    assert "rich" in _requirement_names(project["optional-dependencies"]["cli"])


def test_ray_is_an_extra_not_a_dependency():
    project = _pyproject()["project"]
    assert "ray" not in _requirement_names(project["dependencies"])
    assert "ray" in _requirement_names(project["optional-dependencies"]["ray"])


def test_without_ray_the_package_imports_and_naming_the_ray_strategy_says_how_to_install_it(tmp_path):
    code = """
import json, sys
import lightning.pytorch as pl
import lightning_cannikin
from lightning.pytorch.strategies import StrategyRegistry
ray_modules = sorted(m for m in sys.modules if m.split(".")[0] == "ray")
report = {"registered": "cannikin_ray" in StrategyRegistry, "ray": ray_modules}
for attempt in ("registry", "name"):
    try:
        if attempt == "registry":
            pl.Trainer(strategy="cannikin_ray", accelerator="cpu", logger=False)
        else:
            from lightning_cannikin import CannikinRayStrategy
    except ModuleNotFoundError as error:
        report[attempt] = [error.name, str(error)]
trainer = pl.Trainer(strategy="cannikin_fork", devices=2, accelerator="cpu", logger=False)  # the rest works
report["cannikin"] = type(trainer.strategy).__name__
print(json.dumps(report))
"""
    done = run_without({"ray"}, ["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["registered"] and report["ray"] == [] and report["cannikin"] == "CannikinStrategy", report
    for attempt in ("registry", "name"):
        name, message = report[attempt]
        assert name == "ray" and 'pip install "lightning-cannikin[ray]"' in message, report


def test_plan_prints_plain_aligned_tables_without_rich(tmp_path, capsys):
    profile = write_profile(tmp_path)
    assert cli_main(["plan", str(profile), "-b", "32", "--json"]) == 0
    optimal = json.loads(capsys.readouterr().out)["optimal"]["local_batch_sizes"]
    (tmp_path / "child").mkdir()
    done = run_without(
        {"rich"}, ["-m", "lightning_cannikin.tools.cli", "plan", str(profile), "-b", "32"], tmp_path / "child"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert not any(c in done.stdout for c in "┏━│┃"), "no box drawing: these are not rich's tables"
    header = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    assert re.fullmatch(
        r"rank\s+ms/sample\s+fixed ms\s+optimal b \(ms\)\s+even b \(ms\)\s+proport\. b \(ms\)", lines[header]
    )
    # one row per rank under a rule of dashes, every column right-aligned on its header's right edge
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    rows = lines[header + 2 : header + 4]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    assert all(len(row) == len(lines[header]) for row in rows), rows
    assert f"{optimal[0]} (" in rows[0] and f"{optimal[1]} (" in rows[1]
    assert any(line.startswith("Optimal (OptPerf)") for line in lines)
    assert f"optimal split: {optimal}  predicted step" in done.stdout


def test_the_package_trains_without_rich_and_lightning_keeps_its_tqdm_bar(tmp_path):
    # One fork-launched Trainer with Lightning's default callbacks: with rich installed Lightning would pick its rich
    # progress bar and model summary; without it, TQDM and the plain summary.
    code = """
import json, sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning_cannikin import Cannikin, CannikinStrategy, EmulatedCluster
from tests.models import IndexedRegression, RecordingRegressor, read_records

torch.manual_seed(0)
model = RecordingRegressor(IndexedRegression(96), batch_size=16, record_dir=".")
trainer = pl.Trainer(
    strategy=CannikinStrategy(start_method="fork"), devices=2, accelerator="cpu", max_epochs=2, logger=False,
    enable_checkpointing=False, callbacks=[EmulatedCluster([1.0, 3.0]), Cannikin()],
)
trainer.fit(model)
records = read_records(".", 2)
print(json.dumps({
    "bar": type(trainer.progress_bar_callback).__name__,
    "summary": [type(c).__name__ for c in trainer.callbacks if isinstance(c, ModelSummary)],
    "rich": sorted(m for m in sys.modules if m.split(".")[0] == "rich"),
    "indices": [sorted(i for step in r["steps"] for i in step) for r in records],
}))
"""
    done = run_without({"rich"}, ["-c", code], tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bar"] == "TQDMProgressBar" and report["summary"] == ["ModelSummary"], report
    assert report["rich"] == []
    # both ranks trained: two epochs of 96 samples, each sample once per epoch between them
    assert sorted(report["indices"][0] + report["indices"][1]) == sorted(list(range(96)) * 2)


def test_a_plot_without_matplotlib_is_one_line_saying_how_to_get_it(tmp_path):
    code = """
from lightning_cannikin.tools.report import plot_or_skip
called = []
assert plot_or_skip(called.append, "out/figure.png") is None
assert called == []
"""
    done = run_without(NO_MATPLOTLIB, ["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"skipped the plot {Path('out/figure.png')}: matplotlib is not installed ({PLOTS_INSTALL} to get it)"
    ]
    assert done.stderr == ""


def test_a_plot_with_matplotlib_is_drawn(tmp_path, capsys):
    called = []
    assert plot_or_skip(called.append, tmp_path / "figure.png") == tmp_path / "figure.png"
    assert called == [tmp_path / "figure.png"] and capsys.readouterr().out == ""


def test_report_without_matplotlib_is_one_line_of_error(tmp_path):
    profile = write_profile(tmp_path)
    (tmp_path / "child").mkdir()
    args = ["-m", "lightning_cannikin.tools.cli", "report", str(profile), "-o", str(tmp_path / "r")]
    done = run_without(NO_MATPLOTLIB, args, tmp_path / "child")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"cannikin report: error: needs matplotlib: {PLOTS_INSTALL}"]
    assert not (tmp_path / "r").exists()
