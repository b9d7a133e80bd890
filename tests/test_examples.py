"""examples/ddp_loop.py, the README's plain DDP loop on the public reader, preempted and resumed through torchrun:
the same losses, step for step, as a run that was never interrupted (bitwise on the same 2 ranks; to float
rounding once it resumes on 1 rank, where the global batch's mean is taken in another order)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from warm_ranks import WarmLaunch

STEPS = 100  # a step of the model sized to the plays' 2,048 ids takes milliseconds: room for the notice
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def launch(nproc: int, dataset: Path, checkpoint: Path, warm: bool = False) -> subprocess.Popen | WarmLaunch:
    """The example through torchrun; warm: its ranks forked from the test process's warm server instead
    (tests/warm_ranks.py), for a launch no signal reaches."""
    script, argv = ROOT / "examples/ddp_loop.py", [str(dataset), str(checkpoint), str(STEPS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    if warm:
        return WarmLaunch(nproc, argv, env, ROOT, script=script)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *argv]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def losses(process: subprocess.Popen | WarmLaunch, preempt_after: int | None = None) -> dict[int, float]:
    """The loss of each step the launch printed; with `preempt_after`, SIGTERM to torchrun once that step is
    printed (the ranks may be steps further on when it lands: the save is at whichever step they stop)."""
    found, output = {}, []
    for line in process.stdout:
        output.append(line)
        if match := STEP_LINE.match(line.strip()):
            found[int(match[1])] = float(match[2])
            if preempt_after is not None and int(match[1]) == preempt_after:
                os.killpg(process.pid, signal.SIGTERM)
    status = process.wait(timeout=120)
    assert found and (preempt_after is not None or status == 0), "".join(output[-40:])
    return found


def preempted_launch(nproc: int, dataset: Path, checkpoint: Path, resumes_at: int, tries: int = 3) -> dict[int, float]:
    """A launch through torchrun sent SIGTERM once it printed its third step. The ranks do not wait for the test
    to read their lines: on a loaded machine the notice can land steps later, or after the run's last step. A
    launch it missed is not the example's fault: its checkpoint is put back and the launch made again."""
    before = checkpoint.read_bytes() if checkpoint.exists() else None
    for _ in range(tries):
        launched = losses(launch(nproc, dataset, checkpoint), preempt_after=resumes_at + 3)
        assert max(launched) >= resumes_at + 3, sorted(launched)  # it ended before the notice: no preemption
        if max(launched) < STEPS:  # stopped early: saved where it stopped
            return launched
        checkpoint.unlink()
        if before is not None:
            checkpoint.write_bytes(before)
    raise AssertionError(f"{tries} launches from step {resumes_at} ran to the end though sent a notice: the example "
                         "ignores it, or this machine is too slow for the test's reading of the ranks' lines "
                         f"(last: {sorted(launched)})")


@pytest.mark.long
def test_the_ddp_example_resumes_exactly_after_preemptions_and_on_fewer_ranks(dataset, tmp_path):
    reference = losses(launch(2, dataset, tmp_path / "reference.pt", warm=True))
    assert sorted(reference) == list(range(1, STEPS + 1))

    checkpoint, seen = tmp_path / "run.pt", {}
    for nproc, preempted in ((2, True), (2, True), (1, False)):
        launched = preempted_launch(nproc, dataset, checkpoint, len(seen)) if preempted else losses(
            launch(nproc, dataset, checkpoint, warm=True))
        assert min(launched) == len(seen) + 1, (sorted(seen), sorted(launched))
        expected = [reference[step] for step in sorted(launched)]
        if nproc == 2:
            assert [launched[step] for step in sorted(launched)] == expected  # bitwise
        else:
            assert [launched[step] for step in sorted(launched)] == pytest.approx(expected, rel=1e-5)
        seen.update(launched)
    assert sorted(seen) == list(range(1, STEPS + 1))
