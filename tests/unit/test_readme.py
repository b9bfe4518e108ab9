"""Every code block of README.md is executed or checked here.

Python blocks run, in order, each in a fresh namespace, as ONE 8-rank job (the README's 2x4 mesh); rank 0's
output is checked for what each block prints. The ```text picture must be what visualize_sharding draws.
Shell blocks run in tests/unit/test_readme_shell.py as written where practical (temp dir, small settings); the
lines that need a cluster, a fresh venv or minutes are listed there and in SHELL_BLOCKS with where they are
covered, so a new block cannot go unexercised unnoticed.
"""
import json
import re
from pathlib import Path

import spmd_runtime as sr
from tests.unit.test_cli_mpiexec import ROOT, mpiexec, pytestmark  # noqa: F401 - skipped without mpiexec

README = Path(ROOT) / "README.md"
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)

# first line of each shell block -> why it is not run here, and what covers it
SHELL_BLOCKS = {
    "scripts/demo.sh": "the 8-rank demo (minutes): test_readme_shell runs its training job small; CI runs "
                       "scripts/test.sh, the second line",
    "module load openmpi": "needs a site MPI and a fresh venv: test_readme_shell runs its last line",
    "scripts/launch.sh -n 16": "needs a cluster: test_readme_shell runs both lines with --dry-run",
    "python -m spmd_runtime show PROGRAM.json": "test_readme_shell runs it as written (2 ranks) on a saved program",
    "scripts/emulate_cluster.sh check": "needs root (network namespaces): tests/faults/test_cluster.py runs a cluster "
                                        "of 2 hosts; scripts/test.sh's cluster-2x2 stage runs tests/mpi on it",
}

# Python blocks that are fragments (names the reader supplies): compiled here, not run; first line -> why
PY_FRAGMENTS = {
    "def rnn(h, ws, b):": "uses the reader's x, w, h, ws; tests/unit/test_loops.py runs scan/fori_loop/while_loop/cond",
    "def matmul_reduce_scatter(a, b):                     # inside any traced, auto-partitioned function":
        "uses the reader's mesh; tests/unit/test_shard_map.py runs it (reduce_scatter_matmul)",
    "from spmd_runtime.models import gpt2":
        "continues the block above (opt, rank, the data dir); tests/unit/test_train_model.py and "
        "tests/mpi/test_train_model_mpi.py train GPT-2 as a Model, scripts/demo_gpt2.py runs fit on it",
    "import spmd_runtime as sr                                      # under mpiexec: every rank runs this":
        "200 steps (minutes): tests/mpi/test_tokens_mpi.py and tests/unit/test_tokens.py run fit on prepare_corpus's "
        "files, tests/faults/test_resume.py kills and resumes it",
}


def python_blocks():
    """(blocks to run, fragments) in README order."""
    code = [c for kind, c in BLOCKS if kind == "python"]
    fragments = [c for c in code if c.splitlines()[0] in PY_FRAGMENTS]
    return [c for c in code if c not in fragments], fragments


# what rank 0 prints in each Python block that runs, in order
EXPECTED_OUTPUT = [
    ["[data, R] on Mesh(data=2, model=4), global shape [8, 16]", "(8, 16) ['all_reduce']"],
    ["[] ['reduce_scatter']", "True"],
    ["SPMDProgram on Mesh(data=2, model=4)", "'kind': 'all_reduce'"],
    ["'kind': '"],
    ["predicted on dgx-a100-80gb (rank 0): step", "fits: needs", "autoshard on dgx-a100-80gb: 5 candidates"],
]

DRIVER = """
import json, os, sys, traceback
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
blocks = json.load(open(sys.argv[1]))
os.chdir(sys.argv[2])
out = open(f"rank{rank}.out", "w")
sys.stdout = out
for i, code in enumerate(blocks):
    print(f"=== block {i}", flush=True)
    exec(compile(code, f"README python block {i}", "exec"), {"__name__": "__main__"})
    out.flush()
MPI.COMM_WORLD.Barrier()
"""


def test_every_block_is_known():
    kinds = [k for k, _ in BLOCKS]
    assert set(kinds) <= {"python", "bash", "text", ""}, kinds
    for kind, code in BLOCKS:
        if kind == "bash":
            assert code.splitlines()[0].split("#")[0].strip() in SHELL_BLOCKS or \
                any(code.startswith(k) for k in SHELL_BLOCKS), f"a README shell block nobody covers:\n{code}"
    runnable, fragments = python_blocks()
    assert len(runnable) == len(EXPECTED_OUTPUT)
    for code in fragments:
        compile(code, "README fragment", "exec")


def test_quick_start_is_under_20_lines():
    quick = python_blocks()[0][0]
    assert len(quick.strip().splitlines()) < 20 and "sr.jit" in quick and "sr.device_put" in quick


def test_text_picture_is_what_visualize_draws():
    picture = [code for kind, code in BLOCKS if kind == "text"][0].rstrip("\n")
    mesh = sr.Mesh((2, 4), ("data", "model"))
    assert sr.visualize_sharding(sr.P("data", "model"), mesh, shape=(8, 10), use_rich=False, file=False) == picture


def test_python_blocks_run_on_eight_ranks(tmp_path):
    code = python_blocks()[0]
    (tmp_path / "blocks.json").write_text(json.dumps(code))
    (tmp_path / "driver.py").write_text(DRIVER)
    r = mpiexec(8, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json"), str(tmp_path), timeout=300)
    out = (tmp_path / "rank0.out").read_text() if (tmp_path / "rank0.out").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + out
    printed = re.split(r"^=== block \d+\n", out, flags=re.M)[1:]
    assert len(printed) == len(code)
    for i, (text, wants) in enumerate(zip(printed, EXPECTED_OUTPUT)):
        for want in wants:
            assert want in text, f"README python block {i} should print {want!r}; got:\n{text}"
    other = (tmp_path / "rank1.out").read_text()
    assert "global shape" not in other  # visualize_sharding prints once, on rank 0
