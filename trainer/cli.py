"""``proxrl train``: parse the config, attach to (or start) a server, run the trainer.

proxrl train --server URL --admin-key KEY [--config run.yaml] [key=value ...]
proxrl train --model DIR [--config run.yaml] [key=value ...]   # starts `proxrl serve` too
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import ExitStack

from trainer.config import ConfigError, describe, load_config

EPILOG = "Options (YAML keys; override any with key=value, nested ones dotted):\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="proxrl train",
        description="Train a run on a proxrl server with asynchronous decoupled PPO: claim "
        "rewarded sessions, update the policy with FSDP2 workers on Ray, publish each new "
        "version into the engines while they serve, checkpoint, and resume after a crash.",
        epilog=EPILOG + "\n".join(describe()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="A YAML file of options (see examples/train-*.yaml).")
    p.add_argument("--server", help="Same as server=URL.")
    p.add_argument("--admin-key", help="Same as admin_key=KEY (default: $PROXRL_ADMIN_KEY).")
    p.add_argument("--model", help="Same as model=DIR.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Option overrides.")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_intermixed_args(argv)  # key=value may come before or after flags
    overrides = list(args.overrides)
    for flag, key in (
        (args.server, "server"),
        (args.admin_key, "admin_key"),
        (args.model, "model"),
    ):
        if flag is not None:
            overrides.insert(0, f"{key}={flag}")
    try:
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as exc:
        print(f"proxrl train: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per claim poll says nothing
    from trainer.checkpoint import WrongCheckpoint
    from trainer.claims import ClaimLost
    from trainer.cluster import WorkerLost
    from trainer.model import UnsupportedModel
    from trainer.publish import WeightsUnreadable
    from trainer.run import train
    from trainer.server_api import ServerError

    try:
        with ExitStack() as stack:
            train(config, stack)
    except ConfigError as exc:  # one only the model tells (lora.target_modules)
        print(f"proxrl train: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (
        WrongCheckpoint,
        ClaimLost,
        ServerError,
        UnsupportedModel,
        WeightsUnreadable,
        WorkerLost,
    ) as exc:
        logging.getLogger("proxrl.trainer").error("%s", exc)
        print(f"proxrl train: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
