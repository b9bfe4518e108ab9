"""Exact resume under real MPI: a training job (``sr.fit`` on the bundled corpus, fsdp over 2 ranks, checkpoints
every 2 steps) whose rank 1 is SIGKILLed after step 5 ends with a non-zero status and leaves its step-4
checkpoint; started again it resumes there (parameters, optimizer state, step, loader position) and its losses
and evaluations are those of an uninterrupted job TO THE BIT. Each job is its own ``mpiexec`` (``test_faults``'s
launcher); the uninterrupted and the killed job run concurrently. The same for GPT-2 from the zoo (``sr.Model``)
with dropout on.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from test_faults import HYDRA, ROOT, Case, _launch, run_cases

pytestmark = pytest.mark.skipif(not HYDRA, reason="the fault suite needs MPICH's mpiexec (hydra); "
                                                  "scripts/test.sh installs it")
STEPS, KILL_AFTER, EVERY = 8, 5, 2

MODELS = {  # the built-in LM, and GPT-2 from the zoo as a sr.Model with dropout (each step's masks from the
    # checkpointed update counter, so the resumed steps draw the uninterrupted job's masks)
    "lm": """
    cfg = sr.LMConfig(layers=1, d=16, heads=2, ffn=32, vocab=len(ALPHABET), seq=8, batch=4)""",
    "gpt2": """
    from spmd_runtime.models import gpt2
    g = gpt2.GPTConfig(block_size=8, vocab_size=len(ALPHABET), n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    cfg = sr.Model(lambda p, b, key: gpt2.loss(g, p, b["tokens"], b["labels"], key, train=True),
                   gpt2.param_shapes(g), gpt2.param_roles(g), 4, 8, g.vocab_size,
                   init=lambda seed: gpt2.init_params(g, seed), dropout_seed=0)"""}
TRAIN = f"""
    from spmd_runtime.data import ALPHABET
    MODEL_LINES
    opt = sr.AdamW(lr=sr.CosineSchedule(1e-2, 2, {STEPS}, 1e-3), clip_norm=0.5)
    ts = sr.build_train_step_on_root(cfg, sr.train_mesh((SIZE,), "fsdp"), "fsdp", opt)
    kill_after = int(os.environ.get("KILL_AFTER", "0"))
    step_local, done_here = ts.step_local, []

    def step_and_report(*args, **kwargs):  # every loss exactly (repr), and the fault after step kill_after
        state, loss = step_local(*args, **kwargs)
        done_here.append(loss)
        if RANK == 0:
            print(f"LOSS {{loss!r}}", flush=True)
        if RANK == 1 and len(done_here) == kill_after:
            fault(f"SIGKILL after step {{kill_after}}")
            os.kill(os.getpid(), signal.SIGKILL)
        return state, loss
    ts.step_local = step_and_report
    train, val = sr.token_loaders(ts, os.environ["DATA_DIR"], RANK)
    result = sr.fit(ts, train, {STEPS}, eval_loader=val, eval_every=3, eval_steps=2, checkpoint_every={EVERY},
                    directory=os.environ["CKPT"], log=None)
    if RANK == 0:
        print(f"START {{result.resumed_from}}", flush=True)
        print(f"EVALS {{result.evals!r}}", flush=True)"""


# only rank 0 prints these; hydra may glue another line right after one, so each value is matched by its form
def losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"LOSS ([0-9.eE+-]+)", out)]


def evals(out: str) -> list:
    found = re.search(r"EVALS (\[[^\]]*\])", out)
    return eval(found.group(1)) if found else None  # noqa: S307 - a list of (int, float) this test's job printed


@pytest.mark.parametrize("model", list(MODELS))
def test_a_job_killed_after_step_k_resumes_with_the_same_losses_to_the_bit(tmp_path, model):
    train = TRAIN.replace("\n    MODEL_LINES", MODELS[model])
    sys.path.insert(0, ROOT)
    from spmd_runtime.checkpoint import checkpoint_info
    from spmd_runtime.tokens import prepare_corpus
    data = tmp_path / "corpus"
    prepare_corpus(data, sentences=200)
    env = lambda name, **more: {"DATA_DIR": str(data), "CKPT": str(tmp_path / name), **more}
    straight, killed = Case("uninterrupted", train, env=env("ckpt_straight"), succeeds=True), \
        Case("killed after step k", train, env=env("ckpt_killed", KILL_AFTER=str(KILL_AFTER)))
    dirs = {c.name: str(tmp_path / c.name.split()[0]) for c in (straight, killed)}
    for d in dirs.values():
        os.makedirs(d)
    got = run_cases([straight, killed], lambda case: dirs[case.name])
    a, b = got["uninterrupted"], got["killed after step k"]
    assert a["rc"] == 0 and not a["orphans"], f"the uninterrupted job must succeed:\n{a['output']}"
    assert b["rc"] not in (0, None) and not b["orphans"], f"the killed job must end, non-zero:\n{b['output']}"
    assert "Killed (signal 9)" in b["output"], b["output"]
    assert checkpoint_info(tmp_path / "ckpt_killed")["step"] == KILL_AFTER // EVERY * EVERY  # the last one before the kill

    resumed_dir = tmp_path / "resumed"
    os.makedirs(resumed_dir)
    c = _launch(Case("resumed", train, env=env("ckpt_killed"), succeeds=True), str(resumed_dir))
    assert c["rc"] == 0 and not c["orphans"], f"the restarted job must succeed:\n{c['output']}"
    start = int(re.search(r"START (\d+)", c["output"]).group(1))
    full, head, tail = losses(a["output"]), losses(b["output"]), losses(c["output"])
    assert len(full) == STEPS and start == KILL_AFTER // EVERY * EVERY and len(tail) == STEPS - start
    assert head[:KILL_AFTER] == full[:KILL_AFTER], "the killed job's steps are the uninterrupted job's"
    assert tail == full[start:], f"resumed at step {start}: the same losses to the bit\n{tail}\n{full[start:]}"
    assert evals(c["output"]) == [e for e in evals(a["output"]) if e[0] > start]
    assert checkpoint_info(tmp_path / "ckpt_killed")["step"] == STEPS
