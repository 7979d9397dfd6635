"""`moe-graphs` console script: `doctor` and `demo`."""

from __future__ import annotations

import sys

USAGE = """usage: moe-graphs {doctor,demo} ...

  doctor MODEL_OR_CONFIG_DIR [vLLM engine args]
        print the decode-graph capability report for that model and those engine args;
        exit 0 when eligible, 1 when not, 2 on bad input
  demo [--model SHAPE] [--batch N] ...
        run a shipped Qwen3 model shape (dummy weights) through real vLLM with the plugin
        and print what happened (needs a CUDA GPU; without one it shows the doctor report
        and exits 3)

Reports go to stdout, vLLM's log lines to stderr (unless VLLM_LOGGING_STREAM is set).
Run `moe-graphs doctor --help` or `moe-graphs demo --help` for the options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    from vllm_moe_graphs import envs

    envs.send_vllm_logging_to_stderr()
    if command == "doctor":
        from vllm_moe_graphs.cli.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "demo":
        from vllm_moe_graphs.cli.demo import main as demo_main

        return demo_main(rest)
    print(f"moe-graphs: unknown command {command!r}; expected 'doctor' or 'demo'\n\n{USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
