"""load_npy under threads: simulated ranks must not parse .npy headers at once (python/cpython#106905: CPython
3.11's AST constructor keeps one recursion depth per interpreter, so concurrent ast.literal_eval calls in np.load
can fail with "SystemError: AST constructor recursion depth mismatch", as a fresh-clone CI run did)."""
import io
import threading
import time

import numpy as np

from spmd_runtime import npy


def test_threads_parse_one_header_at_a_time(monkeypatch):
    inside, most = [0], [0]
    real_load = np.load

    def slow_load(*args, **kwargs):  # widens the window in which a second thread would enter
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.005)
        inside[0] -= 1
        return real_load(*args, **kwargs)

    raw = io.BytesIO()
    np.save(raw, np.arange(12.0).reshape(3, 4))
    monkeypatch.setattr(np, "load", slow_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(npy.load_npy(io.BytesIO(raw.getvalue()))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, f"{most[0]} threads were inside np.load at once"
    assert len(results) == 4 and all(np.array_equal(r, np.arange(12.0).reshape(3, 4)) for r in results)
