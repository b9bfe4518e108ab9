"""CPU seconds of sr.autoshard on Megatron-LM Table 1 rows (time.process_time around the call; issue 27).

Usage: PYTHONPATH=. python scripts/autoshard_cpu_seconds.py 18b|145b  (the CLI flags of the issue: bias, tied, bfloat16, full remat)"""
import sys, time
import spmd_runtime as sr
from spmd_runtime.autoshard import autoshard
rows = {"18b": dict(devices=256, layers=40, d=6144, heads=48, ffn=24576, batch=1024),
        "145b": dict(devices=1536, layers=80, d=12288, heads=96, ffn=49152, batch=1536)}
r = rows[sys.argv[1]]
cfg = sr.LMConfig(layers=r["layers"], d=r["d"], heads=r["heads"], ffn=r["ffn"], vocab=51200, seq=2048, batch=r["batch"],
                  bias=True, tied=True, dtype="bfloat16", remat="full")
t = time.process_time()
found = autoshard(cfg, r["devices"], "dgx-a100-80gb", verbose=False)
dt = time.process_time() - t
built = [c for c in found if c.step_s is not None]
print(f"{sys.argv[1]}: {dt:.1f} CPU s, {len(found)} candidates, {sum(c.probe is not None for c in found)} probe rows, "
      f"{sum(c.pruned is not None for c in found)} pruned")
for c in found[:6]:
    print("  ", c, c.peak_bytes and f"{c.peak_bytes/2**30:.1f} GiB", c.probe)
