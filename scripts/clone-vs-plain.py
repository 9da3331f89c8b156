#!/usr/bin/env python3
"""Clone vs plain volume on one CoronaFS server, measured with fio's nbd engine.

Starts `coronafs serve` in a temporary data dir, makes a plain volume and a
base volume (both filled with data), snapshots the base and clones it, then
runs each workload on the plain volume and on a clone, interleaved, for
several iterations, and prints medians, spreads (min..max) and the ratio
clone / plain. Three clone cases:

  clone-inherited  reads of a fresh clone: every byte falls through to the snapshot
  clone-first      random writes to a fresh clone: first touches copy 64 KiB granules
  clone-owned      a clone that has written every granule: the steady state

Usage: scripts/clone-vs-plain.py [--bin target/release/coronafs] [--size 1G]
                                 [--iterations 3] [--runtime 5] [--engine uring]
Needs fio (with the nbd engine).
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc):
    for _ in range(400):
        if proc.poll() is not None:
            sys.exit("coronafs exited early")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listening on {port}")


def api(base, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read() or b"null")


def fio(uri, rw, bs, qd, size, runtime, timed=True):
    cmd = ["fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
           f"--size={size}", "--group_reporting", "--randrepeat=0", "--output-format=json"]
    if timed:
        cmd += [f"--runtime={runtime}", "--time_based", "--ramp_time=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    return {"iops": side["iops"], "mib_s": side["bw_bytes"] / 1048576,
            "p50_us": side["clat_ns"]["percentile"]["50.000000"] / 1000,
            "p99_us": side["clat_ns"]["percentile"]["99.000000"] / 1000}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tdir = os.environ.get("CARGO_TARGET_DIR", "target")
    ap.add_argument("--bin", default=os.path.join(tdir, "release", "coronafs"))
    ap.add_argument("--size", default="1G")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--engine", default="uring", choices=["uring", "threads"])
    a = ap.parse_args()
    if not shutil.which("fio"):
        sys.exit("fio is required (apt-get install fio)")
    size = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(a.size[-1].upper(), 1)
    size *= int(a.size[:-1]) if a.size[-1].isalpha() else int(a.size)
    d = tempfile.mkdtemp(prefix="clone-vs-plain-")
    nbd, http = free_port(), free_port()
    srv = subprocess.Popen([a.bin, "serve", "--data-dir", d, "--nbd", f"127.0.0.1:{nbd}", "--api",
                            f"127.0.0.1:{http}", "--io-engine", a.engine], stderr=subprocess.DEVNULL,
                           # its own server on loopback, without an API token (the calls below send none)
                           env={k: v for k, v in os.environ.items() if k != "CORONAFS_API_TOKEN"})
    try:
        wait_port(http, srv)
        base = f"http://127.0.0.1:{http}"
        uri = lambda n: f"nbd://127.0.0.1:{nbd}/{n}"
        for n in ["plain", "base"]:
            api(base, "POST", "/v1/volumes", {"name": n, "size": size})
            fio(uri(n), "write", "1m", 16, size, 0, timed=False)
        api(base, "POST", "/v1/volumes/base/snapshots", {"name": "gold"})
        api(base, "POST", "/v1/volumes", {"name": "owned", "from_snapshot": "base@gold"})
        fio(uri("owned"), "write", "1m", 16, size, 0, timed=False)
        rows = [  # (label, rw, bs, qd, clone case)
            ("seq-read-1m-qd16", "read", "1m", 16, "inherited"),
            ("rand-read-4k-qd1", "randread", "4k", 1, "inherited"),
            ("rand-read-4k-qd32", "randread", "4k", 32, "inherited"),
            ("rand-write-4k-qd32", "randwrite", "4k", 32, "first"),
            ("seq-write-1m-qd16", "write", "1m", 16, "owned"),
            ("rand-write-4k-qd32", "randwrite", "4k", 32, "owned"),
            ("rand-read-4k-qd32", "randread", "4k", 32, "owned"),
        ]
        res = {(r[0], r[4], p): [] for r in rows for p in ("plain", "clone")}
        for it in range(a.iterations):
            fresh = f"fresh{it}"
            api(base, "POST", "/v1/volumes", {"name": fresh, "from_snapshot": "base@gold"})
            for label, rw, bs, qd, case in rows:
                target = fresh if case in ("inherited", "first") else "owned"
                for peer, vol in (("plain", "plain"), ("clone", target)) if it % 2 == 0 else (("clone", target), ("plain", "plain")):
                    r = fio(uri(vol), rw, bs, qd, size, a.runtime)
                    res[(label, case, peer)].append(r)
                    print(f"iteration {it + 1}/{a.iterations} {label:<20} {peer}-{case if peer == 'clone' else 'volume':<10}"
                          f" {r['iops']:>10.0f} IOPS {r['mib_s']:>9.1f} MiB/s p50 {r['p50_us']:>7.1f} us", file=sys.stderr)
            api(base, "DELETE", f"/v1/volumes/{fresh}")
        print(f"\nCoronaFS clone vs plain volume ({a.engine}, {a.size}, {a.iterations} iterations x {a.runtime} s; median [min..max])\n")
        print(f"| workload | clone case | plain IOPS | clone IOPS | clone/plain | plain p50 us | clone p50 us |")
        print(f"|---|---|---|---|---|---|---|")
        for label, rw, bs, qd, case in rows:
            p, c = res[(label, case, "plain")], res[(label, case, "clone")]
            med = lambda xs, k: statistics.median(x[k] for x in xs)
            spread = lambda xs, k: f"[{min(x[k] for x in xs):.0f}..{max(x[k] for x in xs):.0f}]"
            print(f"| {label} | {case} | {med(p, 'iops'):.0f} {spread(p, 'iops')} | {med(c, 'iops'):.0f} {spread(c, 'iops')} "
                  f"| {med(c, 'iops') / med(p, 'iops'):.2f} | {med(p, 'p50_us'):.1f} | {med(c, 'p50_us'):.1f} |")
    finally:
        srv.kill()
        srv.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
