"""Summarize bench/soak.sh: per transport configuration, the soak run (requests, failures,
busy, duration, latency) and the churn run (cycles, failures, duration), each with its leak
checks (server descriptors against the baseline, sockets still holding connection state, BPF
map entries at stop)."""
import json, os, re, sys, datetime, platform

out, rev, cmd, requests, rate, cycles = sys.argv[1:7]
machine = None
runs = {}
for line in open(os.path.join(out, "records.tsv")):
    cond, kind, rc, src, base, fds, conns, sockhash, states, t0, t1 = line.rstrip("\n").split("\t")
    leak = {
        "server_fds_baseline": int(base), "server_fds_after": int(fds),
        "fds_back_to_baseline": int(fds) <= int(base),
        "sockets_with_connection_state_after": int(conns),
        "bpf_sockhash_entries_at_stop": None if sockhash == "null" else int(sockhash),
        "bpf_connection_states_at_stop": None if states == "null" else int(states),
    }
    leak["ok"] = (leak["fds_back_to_baseline"] and int(conns) == 0
                  and leak["bpf_sockhash_entries_at_stop"] in (None, 0)
                  and leak["bpf_connection_states_at_stop"] in (None, 0)
                  and int(src) == 0)
    rec = {"client_exit": int(rc), "server_exit": int(src),
           "wall_s": round(float(t1) - float(t0), 1), "leak_check": leak}
    # The server's own counters at shutdown (the runs include a 16-cycle warm-up and the
    # client's 64 golden requests): connections accepted/closed, executor requests/completions.
    try:
        log = open(os.path.join(out, f"{cond}-{kind}.server.log")).read()
        ex = re.search(r"executor: (\d+) requests, (\d+) completions", log)
        co = re.search(r"(\d+) accepted, (\d+) closed", log)
        rec["server_counters"] = {
            "executor_requests": int(ex.group(1)) if ex else None,
            "executor_completions": int(ex.group(2)) if ex else None,
            "connections_accepted": int(co.group(1)) if co else None,
            "connections_closed": int(co.group(2)) if co else None,
        }
    except OSError:
        pass
    path = os.path.join(out, f"{cond}-{kind}.json")
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        doc = None
        rec["error"] = f"no client report: {e}"
    if kind == "soak" and doc:
        machine = doc.get("machine")
        r = doc["report"]
        lat = r.get("latency") or {}
        s = (r.get("server_cpu") or {}).get("per_request", {})
        rec.update({
            "requests": r["scheduled"], "ok": r["counts"]["ok"], "failures": r["failures"],
            "busy": r["counts"]["busy"], "counts": r["counts"],
            "warmup_requests": r["warmup_scheduled"], "warmup_failures": r["warmup_failures"],
            "offered_rate": round(r["offered_rate"], 1), "achieved_rate": round(r["achieved_rate"], 1),
            "duration_s": round(r["measured_interval_s"], 1),
            "p50_us": lat.get("p50_us"), "p99_us": lat.get("p99_us"), "max_us": lat.get("max_us"),
            "server_schedstat_us_per_req": s.get("run_us"),
        })
    elif kind == "churn" and doc:
        rec.update({"cycles": doc["cycles"], "ok": doc["ok"], "failures": doc["failures"],
                    "duration_s": doc["seconds"], "cycles_per_sec": doc["cycles_per_sec"],
                    "first_failure": doc["first_failure"]})
    rec["passed"] = (rec["client_exit"] == 0 and leak["ok"] and "error" not in rec
                     and rec.get("failures") == 0)
    runs.setdefault(cond, {})[kind] = rec

print(json.dumps({
    "what": "soak (gemm8 x1, exact replay, bgs load --strict) and connection churn "
            "(connect / one gemm8 request / close) per transport, CPU executor, 1 slot; "
            "server on CPU 0, clients on the others",
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": machine or {"hostname": platform.node(), "cpus": os.cpu_count(),
                           "kernel": platform.release()},
    "command": cmd, "git_revision": rev,
    "soak_requests": int(requests), "soak_rate": float(rate), "churn_cycles": int(cycles),
    "transports": {"native": "--transport native",
                   "kernel-loop": "--transport kernel --reply loop",
                   "kernel-sqe": "--transport kernel --reply executor-sqe"},
    "runs": runs,
    "all_passed": all(r["passed"] for c in runs.values() for r in c.values()),
}, indent=2))
