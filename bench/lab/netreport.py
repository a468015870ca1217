"""The network benchmark's Markdown: throughput against the unshaped limit, time to target against hivemind, bytes on
the wire against the synchronizer's payload and its formula, CPU per step, and where the time goes."""

from __future__ import annotations


def _f(v, fmt: str = ".0f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def limit_of(rows: list[dict], row: dict) -> dict | None:
    """The same workload's unshaped segment of the same run."""
    if row["scenario"] == "unshaped":
        return None
    return next((r for r in rows if r["scenario"] == "unshaped" and r["label"] == row["label"]), None)


def ratio(row: dict, base: dict | None) -> float | None:
    if base is None or not row.get("tokens_per_s") or not base.get("tokens_per_s"):
        return None
    return row["tokens_per_s"] / base["tokens_per_s"]


def where_time_goes(row: dict, base: dict | None) -> str:
    """A line on what a shaped step spends beyond the unshaped one: link busy share, CPU, waiting."""
    if not row.get("s_per_step"):
        return "; ".join(row.get("errors") or ["no window measured"])[:160]
    nodes = row.get("nodes") or []
    up = [n["uplink_busy"] for n in nodes if n.get("uplink_busy") is not None]
    down = [n["downlink_busy"] for n in nodes if n.get("downlink_busy") is not None]
    parts = [f"{row['s_per_step']:.3f} s/step"]
    w = row.get("window") or {}
    if not row.get("window_complete") and w:
        parts.append(f"window cut at step {w['to_step']:.0f} by the time limit")
    if base and base.get("s_per_step"):
        parts[0] += f" (unshaped {base['s_per_step']:.3f})"
    if up:
        parts.append(f"uplink busy {100 * max(up):.0f}%")
    if down:
        parts.append(f"downlink busy {100 * max(down):.0f}%")
    cpu = row.get("cpu_s_per_step")
    if cpu is not None:
        parts.append(f"CPU {cpu:.3f} s/step/node" + (f" (unshaped {base['cpu_s_per_step']:.3f})"
                                                      if base and base.get("cpu_s_per_step") else ""))
    r = ratio(row, base)
    if r is not None and r < 0.9:
        if up and max(up) > 0.7 or down and max(down) > 0.7:
            parts.append("link-bound: the synchronizer's bytes fill the link")
        else:
            parts.append("links not full: waiting on round trips and the slowest member")
    return "; ".join(parts)


def cpu_split(row: dict) -> str:
    nodes = row.get("nodes") or []
    if not nodes:
        return "-"
    keys = ("loop", "worker", "other", "children")
    mean = {k: sum(n["cpu_s_per_step"].get(k, 0.0) for n in nodes) / len(nodes) for k in keys}
    return " / ".join(_f(mean[k], ".3f") for k in keys)


def markdown(doc: dict) -> str:
    c = doc["config"]
    s = c["segment"]
    rows = doc["rows"]
    out = [f"# shoal bench network: {', '.join(c['scenarios'])}", "",
           f"Command: `{doc['command']}`", "",
           f"Machine: {doc['machine']}. Whole run: {doc['wall_s']:.0f} s.", "",
           f"Each segment: {s['nodes']} `shoal node` processes (all active replicas, no backup), each in its own "
           f"network namespace on a bridge that lives in a switch namespace, links shaped with tbf on both veth ends; "
           f"the `{s['size']}` model{_layers(s)}, lr {s['lr']}, eval every {s['eval_every']} steps, at most {s['max_steps']} "
           f"steps or {s['time_limit_s']:.0f} s of training; status every {s['status_interval_s']} s "
           f"(the node's default). Throughput, bytes and CPU are measured from step {s['window_steps'][0]} to "
           f"step {s['window_steps'][1]} (past start-up and CocktailSGD's warm-up). Each shaping was checked by a "
           "TCP probe before use (below). Ratios compare segments of this one run.", ""]
    out += ["## Throughput, bytes and CPU", "",
            "| links | workload | tokens/s | vs unshaped | payload B/step/node (formula) | wire B/step/node "
            "| wire / payload | packets/step/node | CPU s/step/node: loop / trainer / other / children | where the time goes |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        base = limit_of(rows, r)
        rt = ratio(r, base)
        pkts = [n["tx_packets_per_step"] for n in r.get("nodes") or []]
        formula = r.get("payload_formula_bytes")
        out.append(
            f"| {r['scenario']} | {r['label']} | {_f(r.get('tokens_per_s'))} | {_f(rt, '.2f')} | "
            f"{_f(r.get('payload_bytes_per_step'))} ({_f(formula)}) | {_f(r.get('wire_tx_bytes_per_step'))} | "
            f"{_f(r.get('wire_over_payload'), '.2f')} | {_f(sum(pkts) / len(pkts) if pkts else None, '.1f')} | "
            f"{cpu_split(r)} | {where_time_goes(r, base)} |")
    out += ["", "Payload: the synchronizer's tensor frames a node sent per step (its status `bytes_sent`), beside the "
            "formula for its codec (payload bytes without frame headers: 2(D-1) chunks of N/D parameters; DiLoCo per "
            "step, its all-reduce every H steps). Wire: every byte the node's veth sent (Ethernet frames: "
            "TCP/IP headers, Noise and yamux framing, acknowledgements, gossip, DHT, RPC), per synchronized step. "
            "CPU: the node process's threads (loop: trio, libp2p, Noise; trainer: trio worker threads, i.e. the "
            "step with its synchronous exchange; other: pools such as CocktailSGD's background round; children: "
            "hivemind's p2pd).", ""]
    out += ["## Time to the target held-out loss", ""]
    target = s.get("target_loss")
    if target is None:
        out += ["No target loss set for this run.", ""]
    else:
        out += [f"Target: node 0's held-out loss (the same {s['nodes']}x8 held-out batches for every system) at or "
                f"below {target}, timed from node 0's first step to the step whose state reached it.", "",
                "| links | system | time to target (s) | at step | last held-out loss | vs best hivemind |",
                "|---|---|---:|---:|---:|---:|"]
        for r in rows:
            hm = [x for x in rows if x["scenario"] == r["scenario"] and x.get("kind") == "hivemind"]
            best = min((x["time_to_target_s"] for x in hm if x.get("time_to_target_s") is not None), default=None)
            limit_hm = max((x.get("training_s") or 0 for x in hm), default=0)
            vs = "-"
            if r.get("kind") == "shoal" and r.get("time_to_target_s"):
                if best is not None:
                    vs = f"{best / r['time_to_target_s']:.1f}x sooner"
                elif hm and limit_hm:
                    vs = f">= {limit_hm / r['time_to_target_s']:.1f}x sooner (hivemind did not reach it in {limit_hm:.0f} s)"
            out.append(f"| {r['scenario']} | {r['label']} | {_f(r.get('time_to_target_s'), '.1f', 'not reached')} | "
                       f"{_f(r.get('target_step'))} | {_f(r.get('final_eval_loss'), '.3f')} | {vs} |")
        out.append("")
    hm_rows = [r for r in rows if r.get("kind") == "hivemind"]
    if hm_rows:
        h = hm_rows[0]["hivemind"]
        out += ["hivemind 1.1.12 (its own venv) trains the same model on the same corpus: the run's manifest gives "
                "model, data, batch, AdamW settings, learning-rate schedule, clipping, seed and held-out batches; "
                f"peer i reads shard i of {s['nodes']}; `hivemind.Optimizer` with target_batch_size "
                f"{h['target_batch_size']} (= the shoal swarm's samples per synchronized step), gradient averaging "
                f"(use_local_updates=False) and its default state averaging every epoch, matchmaking_time "
                f"{h['matchmaking_time_s']} s (its quickstart value; the default 15 s is for large batches), "
                "averaging_timeout "
                f"{h['averaging_timeout_s']} s. `hivemind` is its default (no compression); `hivemind 8bit` uses "
                "Uniform8BitQuantization for gradients and state averaging, its best codec in "
                "bench/results/codecs.md. Its step is its epoch.", ""]
    out += ["## Link checks (TCP probe, goodput in Mbit/s)", ""]
    for name, results in doc["probes"].items():
        items = ", ".join(f"n{p['node']} {p['direction']} {p['measured_mbit']:.1f}"
                          + (f"/{p['expected_mbit']:.1f}" if p.get("expected_mbit") else "")
                          + ("" if p["ok"] else " OFF") for p in results)
        out.append(f"- {name}: {items}")
    if doc.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    if doc.get("targets"):
        out += ["", "## Targets", ""] + [f"- {t}" for t in doc["targets"]]
    return "\n".join(out) + "\n"


def targets(rows: list[dict]) -> list[str]:
    """The issue's three targets, where this run measured them."""
    out = []
    for r in rows:
        if r["label"] == "cocktail" and r["scenario"] == "sym-10":
            rt = ratio(r, limit_of(rows, r))
            if rt is not None:
                out.append(f"cocktail at 10 Mbit/s: {rt:.2f} of its unshaped tokens/s (target >= 0.9): "
                           f"{'met' if rt >= 0.9 else 'NOT met'}")
    for r in rows:
        if r.get("kind") != "shoal" or not r.get("time_to_target_s"):
            continue
        hm = [x for x in rows if x["scenario"] == r["scenario"] and x.get("kind") == "hivemind"]
        if not hm:
            continue
        best = min((x["time_to_target_s"] for x in hm if x.get("time_to_target_s") is not None), default=None)
        if best is None:
            lim = max((x.get("training_s") or 0 for x in hm), default=0)
            out.append(f"{r['label']} on {r['scenario']}: target loss after {r['time_to_target_s']:.0f} s; hivemind "
                       f"did not reach it within {lim:.0f} s (>= {lim / r['time_to_target_s']:.1f}x; target >= 2x): "
                       f"{'met' if lim >= 2 * r['time_to_target_s'] else 'not shown'}")
        else:
            sp = best / r["time_to_target_s"]
            out.append(f"{r['label']} on {r['scenario']}: {sp:.1f}x sooner than hivemind's best (target >= 2x): "
                       f"{'met' if sp >= 2 else 'NOT met'}")
    for r in rows:
        if r["label"] == "cocktail" and r.get("wire_over_payload"):
            out.append(f"cocktail on {r['scenario']}: wire bytes {r['wire_over_payload']:.2f}x payload "
                       f"(target <= 1.2x): {'met' if r['wire_over_payload'] <= 1.2 else 'NOT met'}")
    return out


def _layers(segment: dict) -> str:
    """' with N layers' when the run overrode the preset's layer count (older results carry no such field)."""
    return f" with {segment['layers']} layers" if segment.get("layers") else ""
