"""The ``arc-evictor`` command: simulate traces (on one replica or a routed fleet),
generate workloads, evaluate the policies and study scaling.

    arc-evictor simulate TRACE --policy lru,dbl,arc --capacity 1000,10% [--sequential]
                         [--replicas N --router kv_aware,... [--router-temperature T]
                          [--session-affinity-ttl SECONDS]]
                         [--format auto] [--json] [--time-scale F]
                         [--prefill-tokens-per-second R] [--decode-seconds-per-token S] ...
                         [--plot FILE.png]
    arc-evictor scale [--out out/scale] [--replicas 1,2,4,8,16,32] [--router ...] [--trace ...]
                      [--time-scale F] [--prefill-tokens-per-second R] ...
    arc-evictor generate docqa|conversation --out FILE [--form bailian] [--seed 0] ...
    arc-evictor sessions TRACE [--json]
    arc-evictor evaluate [--out out/evaluate] [--seeds 0,1,2] [--capacity 5,10,20,40] [--check]

Bad input (an unknown policy, a malformed trace line, a bad capacity, an unknown
flag) prints one line naming the problem to stderr and exits with status 2 before
any work, creating or changing no file or folder.

``simulate`` and ``scale`` print a warning to stderr when the offered load exceeds what
the replicas serve (``scaling.overload_warnings``), and when a router that keeps a session
on one replica runs on a trace whose largest session holds more than a quarter of its
requests (``routing.crowded_session``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from arc_serving_common.traces import FORMATS, load_trace
from arc_simulator.command import UsageError, program_parser, run, writable_folder
from arc_simulator.fleet import check_fleet, fleet_sweep
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    conversation,
    docqa,
    write_generated,
)
from arc_simulator.report import plot, table, to_json
from arc_simulator.routing import check_router, crowded_session, router_names
from arc_simulator.scaling import (
    add_load_arguments,
    add_scale_command,
    cost_from_args,
    overload_warnings,
    time_scale_from_args,
)
from arc_simulator.session_check import add_sessions_command
from arc_simulator.simulate import build_policy, simulator_policy_names, sweep, time_scaled


def parse_policies(text: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",")]
    if not any(names):
        raise UsageError(f"--policy needs at least one of: {', '.join(simulator_policy_names())}")
    if not all(names):  # "arc,,lru" or a trailing comma: a name is missing
        raise UsageError(f"--policy {text!r}: an empty name between commas")
    for name in names:
        build_policy(name, 1, [])
    return names


def parse_routers(
    text: str, replicas: int, temperature: float = 0.0, affinity_ttl_s: int | None = None
) -> list[str]:
    names = [name.strip().lower() for name in text.split(",")]
    if not all(names):
        raise UsageError(
            f"--router {text!r}: an empty name; valid routers: {', '.join(router_names())}"
        )
    for name in names:
        check_router(name, replicas, temperature, affinity_ttl_s)
    return list(dict.fromkeys(names))


def parse_capacities(text: str, distinct_blocks: int) -> list[int]:
    """Block counts, or percentages of the trace's distinct blocks (``10%``)."""
    capacities = []
    for item in (part.strip() for part in text.split(",")):
        try:
            if item.endswith("%"):
                share = float(item[:-1])
                if not 0 < share <= 1000:
                    raise ValueError
                capacities.append(max(1, round(distinct_blocks * share / 100)))
            else:
                capacities.append(int(item))
        except ValueError:
            raise UsageError(
                f"--capacity item {item!r} is neither a block count nor a percentage like 10%"
            ) from None
        if capacities[-1] < 1:
            raise UsageError(f"--capacity {item!r}: a cache needs at least 1 block")
    return sorted(set(capacities))


def _simulate(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policy)
    cost = cost_from_args(args)
    time_scale = time_scale_from_args(args)
    parse_capacities(args.capacity, 1)  # the syntax, before the trace is read
    routers: list[str] = []
    if args.router is not None and args.replicas is None:
        raise UsageError("--router needs --replicas N (how many replicas to route over)")
    if args.router_temperature is not None and args.router is None:
        raise UsageError("--router-temperature needs --router kv_aware and --replicas N")
    temperature = 0.0 if args.router_temperature is None else args.router_temperature
    if args.session_affinity_ttl is not None and args.router is None:
        raise UsageError("--session-affinity-ttl needs --router kv_aware and --replicas N")
    if args.replicas is not None:
        if args.router is None:
            raise UsageError(
                f"--replicas needs --router, one or more of: {', '.join(router_names())}"
            )
        routers = parse_routers(args.router, args.replicas, temperature, args.session_affinity_ttl)
        for name in policies:
            check_fleet(name, args.replicas)
    if args.plot and not writable_folder(args.plot):
        raise UsageError(f"--plot {args.plot}: cannot write into {args.plot.parent}")
    requests = time_scaled(
        load_trace(args.trace, args.format, block_tokens=args.block_tokens), time_scale
    )
    distinct = len({key for request in requests for key in request.keys})
    capacities = parse_capacities(args.capacity, distinct)
    crowded = crowded_session(requests, str(args.trace), routers, args.session_affinity_ttl)
    if crowded is not None:
        print(f"arc-evictor: warning: {crowded}", file=sys.stderr)
    if routers:
        results = fleet_sweep(
            requests,
            policies,
            capacities,
            args.replicas,
            routers,
            sequential=args.sequential,
            cost=cost,
            seed=args.seed,
            temperature=temperature,
            affinity_ttl_s=args.session_affinity_ttl,
        )
    else:
        results = sweep(requests, policies, capacities, sequential=args.sequential, cost=cost)
    if args.json:
        print(to_json(results))
    else:
        mode = "sequential" if args.sequential else "overlapping"
        fleet = f", {args.replicas} replicas (capacity per replica)" if routers else ""
        print(
            f"{args.trace}: {len(requests):,} requests, {distinct:,} distinct blocks, "
            f"{mode} mode{fleet}"
        )
        print(table(results))
    if args.plot:
        title = f"{Path(args.trace).name} ({distinct:,} distinct blocks)"
        try:
            written = plot(results, args.plot, title)
        except OSError as error:
            raise UsageError(f"--plot {args.plot}: {error.strerror}") from None
        print(f"plot written to {written}", file=sys.stderr if args.json else sys.stdout)
    rows = [{**result.as_dict(), "trace": Path(args.trace).name} for result in results]
    for warning in overload_warnings(rows, time_scale, cost):
        print(warning, file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    params_type = DocQAParams if args.workload == "docqa" else ConversationParams
    own = {field.name for field in fields(params_type)}
    foreign = sorted(
        "--" + field.name.replace("_", "-")
        for other in (DocQAParams, ConversationParams)
        for field in fields(other)
        if field.name not in own and getattr(args, field.name, None) is not None
    )
    if foreign:
        raise UsageError(f"{', '.join(foreign)}: not a parameter of the {args.workload} workload")
    overrides = {
        field.name: getattr(args, field.name)
        for field in fields(params_type)
        if getattr(args, field.name, None) is not None
    }
    if not writable_folder(args.out):
        raise UsageError(f"--out {args.out}: cannot write a file there")
    try:
        params = params_type(**overrides)
        requests = docqa(params) if args.workload == "docqa" else conversation(params)
        if args.block_tokens is None or args.block_tokens >= 1:  # else write_generated says so
            args.out.parent.mkdir(parents=True, exist_ok=True)  # like --plot and evaluate --out
        count = write_generated(args.out, requests, args.form, args.block_tokens)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"cannot write {args.out}: {error.strerror}") from None
    print(f"wrote {count:,} requests ({args.workload}, {args.form} form) to {args.out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    # Imported here: the evaluation pulls in matplotlib, which the other commands do not need.
    from arc_simulator.evaluate import EvaluationConfig, check_targets, run_evaluation, table

    try:
        seeds = tuple(int(seed) for seed in args.seeds.split(","))
        percents = tuple(float(item.rstrip("%")) for item in args.capacity.split(","))
    except ValueError:
        raise UsageError(
            f"--seeds {args.seeds!r} and --capacity {args.capacity!r} must be comma-separated"
            " numbers"
        ) from None
    modes = ("sequential", "overlapping") if args.mode == "both" else (args.mode,)
    try:
        candidate = {"candidate": args.candidate.strip().lower()} if args.candidate else {}
        config = EvaluationConfig(
            **candidate,
            seeds=seeds,
            capacity_percents=percents,
            modes=modes,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not writable_folder(args.out / "evaluate.txt"):
        raise UsageError(f"--out {args.out}: not a folder this user can write into")
    rows = run_evaluation(config, args.out, lambda line: print(line, file=sys.stderr))
    print(table(rows))
    misses = check_targets(rows)
    print(f"\nresults, plots and traces in {args.out}")
    print(f"{config.candidate}: {len(misses)} target misses" + "".join(f"\n  {m}" for m in misses))
    return 1 if misses and args.check else 0


def build_parser() -> argparse.ArgumentParser:
    parser, commands = program_parser()

    simulate = commands.add_parser("simulate", help="replay a trace through policies and sizes")
    simulate.add_argument("trace", help="trace file (Mooncake or Qwen-Bailian JSON lines)")
    simulate.add_argument(
        "--policy",
        default="lru,dbl,arc",
        help=f"comma-separated policies, from: {', '.join(simulator_policy_names())}",
    )
    simulate.add_argument(
        "--capacity",
        default="5%,10%,20%,40%",
        help="comma-separated cache sizes in blocks, or percentages of distinct blocks",
    )
    simulate.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    simulate.add_argument("--block-tokens", type=int, help="tokens per hash id (default by form)")
    simulate.add_argument(
        "--sequential", action="store_true", help="one request at a time (the reference mode)"
    )
    simulate.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    simulate.add_argument("--plot", type=Path, help="write hit rate against capacity to FILE.png")
    fleet = simulate.add_argument_group("fleet (several replicas behind a router; see routing)")
    fleet.add_argument(
        "--replicas", type=int, help="replicas, each with a cache of --capacity blocks"
    )
    fleet.add_argument(
        "--router", help=f"comma-separated routers, from: {', '.join(router_names())}"
    )
    fleet.add_argument(
        "--seed", type=int, default=0, help="seed of random and of kv_aware's temperature draws"
    )
    fleet.add_argument(
        "--router-temperature",
        type=float,
        help="kv_aware: 0 (the default) takes the least cost, above 0 draws with weights "
        "exp(-(cost - least) / T), as vllm-router's flag",
    )
    fleet.add_argument(
        "--session-affinity-ttl",
        type=int,
        metavar="SECONDS",
        help="kv_aware: keep each session on the replica of its last request while it pauses "
        "no longer than this, as vllm-router's --kv-aware-session-affinity-ttl-secs",
    )
    add_load_arguments(simulate)
    simulate.set_defaults(run=_simulate)

    generate = commands.add_parser("generate", help="write a generated workload as a trace")
    generate.add_argument("workload", choices=["docqa", "conversation"])
    generate.add_argument("--out", type=Path, required=True, help="trace file to write")
    generate.add_argument("--form", default="bailian", choices=FORMATS, help="trace form")
    generate.add_argument("--block-tokens", type=int, help="tokens per hash id (default by form)")
    for params_type in (DocQAParams, ConversationParams):
        for field in fields(params_type):
            option = "--" + field.name.replace("_", "-")
            if option not in generate._option_string_actions:
                kind = int if field.type in ("int", int) else float
                generate.add_argument(
                    option, type=kind, dest=field.name, help=f"default {field.default}"
                )
    generate.set_defaults(run=_generate)

    evaluate = commands.add_parser(
        "evaluate", help="the evaluation: every policy and Belady on the evaluation traces"
    )
    evaluate.add_argument("--out", type=Path, default=Path("out/evaluate"), help="output folder")
    evaluate.add_argument("--seeds", default="0,1,2", help="generator seeds, comma-separated")
    evaluate.add_argument(
        "--capacity", default="5,10,20,40", help="capacities in percent of distinct blocks"
    )
    evaluate.add_argument("--mode", default="both", choices=["both", "sequential", "overlapping"])
    evaluate.add_argument(
        "--candidate", help="the policy judged against targets (default: the evaluation's, trio)"
    )
    evaluate.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target is missed"
    )
    evaluate.set_defaults(run=_evaluate)

    add_scale_command(commands)
    add_sessions_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
