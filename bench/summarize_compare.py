"""Summarize bench/transport_compare.sh: per condition and rate, mean over rounds (and each
round) of server process CPU per request (user, system, schedstat), host softirq and busy CPU
per request, p50/p99 latency and achieved rate."""
import glob, json, os, re, sys, datetime, statistics

out, rev = sys.argv[1], sys.argv[2]
rows = {}
machine = None
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    m = re.match(r"(native|kernel-loop|kernel-sqe)-(\d+)-r(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    doc = json.load(open(path))
    machine = doc.get("machine")
    r = doc["report"]
    s = (r.get("server_cpu") or {}).get("per_request", {})
    h = (r.get("host_cpu") or {}).get("per_request", {})
    lat = r.get("latency") or {}
    rows.setdefault((m.group(1), int(m.group(2))), []).append({
        "round": int(m.group(3)),
        "offered_rate": r["offered_rate"], "achieved_rate": r["achieved_rate"],
        "failures": r["failures"] + r["warmup_failures"], "busy": r["counts"]["busy"],
        "p50_us": lat.get("p50_us"), "p99_us": lat.get("p99_us"),
        "server_user_us": s.get("user_us"), "server_sys_us": s.get("system_us"),
        "server_schedstat_us": s.get("run_us"),
        "host_softirq_us": h.get("softirq_us"), "host_busy_us": h.get("busy_us"),
    })

def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None

summary = []
for (cond, rate), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    keys = [k for k in runs[0] if k != "round"]
    summary.append({"condition": cond, "rate": rate, "rounds": len(runs),
                    "mean": {k: mean([r[k] for r in runs]) for k in keys},
                    "runs": sorted(runs, key=lambda r: r["round"])})
print(json.dumps({
    "benchmark": "kernel transport (loop, executor-sqe) vs native, CPU executor, gemm8 r=1 (bench/transport_compare.sh)",
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "git_revision": rev, "machine": machine,
    "notes": ["server pinned to CPU 0 with 1 executor slot; load generator on the other CPUs",
              "server CPU is process-group CPU (all threads incl. io_uring SQPOLL/io-wq); softirq and busy are whole-host per request",
              "on loopback the receive softirq (incl. the BPF verdict program) runs in the sender's context"],
    "results": summary}, indent=2))
