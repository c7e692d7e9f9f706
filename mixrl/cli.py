"""The ``mixrl`` command.

Every subcommand lives in its own module with ``main(argv: list[str]) -> int`` and is imported only
when called, so ``mixrl validate`` and ``mixrl crds`` start without importing torch or kopf.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module exposing main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("mixrl.rl.environments.validate_cmd", "check RLRun YAML files; one line per problem"),
    "crds": ("mixrl.api.crd_cmd", "write (or --check) crds/*.yaml from the API models"),
    "run": ("mixrl.local.run", "run an RLRun on this machine with the same components"),
    "report": ("mixrl.local.report", "redraw the plots and report of a run directory"),
    "ablate": ("mixrl.local.ablation", "the stability study: corrections arms x fleets x seeds, one table"),
    "engine": ("mixrl.rl.engine.server", "serve a transformers model with SGLang's HTTP API"),
    "router": ("mixrl.rl.router", "session router across sampler pools"),
    "rollout": ("mixrl.rl.rollout.worker", "agent loops producing trajectories"),
    "evaluate": ("mixrl.rl.rollout.evaluator", "held-out pass@k on a BF16 engine, exactly the version named"),
    "buffer": ("mixrl.rl.buffer", "trajectory buffer service"),
    "trainer": ("mixrl.rl.trainer.main", "policy trainer (torch FSDP2 or Megatron backend)"),
    "prepare-model": (
        "mixrl.rl.prepare_model",
        "build a tiny: model as mixrl run does (a trainer pod's init container)",
    ),
    "operator": ("mixrl.operator.main", "the Kubernetes operator (kopf)"),
    "sandbox-exec": ("mixrl.rl.sandbox.executor", "inside a sandbox pod: run one command per HTTP request"),
    "engine-sync": ("mixrl.rl.engine.weight_sync", "sidecar: load each new weight version into one engine"),
    "simulate": ("mixrl.sim.simulate", "fleet simulator for autoscaling policies"),
    "dev-cluster": (
        "mixrl.devcluster.cli",
        "a real Kubernetes control plane with a simulated GPU fleet (and real CPU nodes)",
    ),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mixrl COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`mixrl COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from mixrl import __version__

        print(f"mixrl {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"mixrl: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("mixrl"):
            print(
                f"mixrl: command {name!r} is not available in this build ({exc.name} missing)",
                file=sys.stderr,
            )
            return 2
        raise
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
