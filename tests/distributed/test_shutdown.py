"""shutdown() leaves no process group alive: a gloo group's worker threads still running at interpreter exit abort the
process now and then (a finished collective's tensors released without the GIL), so every one must be gone."""
import os
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent("""
    import os
    from tp_lora import distributed as comm

    def gloo_threads():
        names = []
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        return sum("gloo" in n for n in names)

    ps = comm.init_parallel(1, "cpu", timeout_s=60)
    comm.init_expert_parallel(ps, 2, "dp", timeout_s=60)
    comm.all_gather_object(ps.rank, ps.ep)
    before = gloo_threads()
    del ps  # the caller's references go; what the module keeps is shutdown's to drop
    comm.shutdown()
    with open(f"rank{os.environ['RANK']}.txt", "w") as f:
        f.write(f"{before} {gloo_threads()}")
""")


def test_shutdown_ends_every_gloo_worker(tmp_path):
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through Linux's /proc")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        before, after = map(int, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert before > 0 and after == 0, (rank, before, after)
