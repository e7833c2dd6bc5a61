"""`kvstage prefill --listen HOST:PORT`: serve a prefill role until SIGINT/SIGTERM.

Its forward pass is the verifiable pattern (`kvstage.testing.pattern`): decode asks it
to "run" prompts over the side channel. On a signal it frees held requests, deregisters
memory and closes.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from kvstage.cli import args as cli_args
from kvstage.cli import net
from kvstage.errors import KVStageError
from kvstage.pd.prefill import DEFAULT_LEASE_S
from kvstage.pd.side_channel import parse_address
from kvstage.testing.servers import make_prefill

DEFAULT_PORT = 5600


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}",
                   type=cli_args.address("--listen", listen=True),
                   help="HOST:PORT of the side channel (port 0 picks a free one)")
    p.add_argument("--lease-s", type=cli_args.positive(float, "--lease-s", high=86400.0),
                   default=DEFAULT_LEASE_S)
    cli_args.add_layout_arguments(p)
    cli_args.add_ucx_arguments(p)
    cli_args.add_auth_arguments(p)
    cli_args.add_integrity_argument(p)


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_address(args.listen)
        layout = cli_args.layout_from_args(args)
        key = cli_args.key_from_args(args, host, "prefill")
    except (KVStageError, argparse.ArgumentTypeError) as exc:
        print(f"kvstage prefill: {exc}", file=sys.stderr)
        return 2
    ucx = cli_args.setup_ucx(args, host)
    try:
        worker = make_prefill(
            layout, host=host, port=port, device=args.device, host_layout=args.host_layout,
            lease_s=args.lease_s, transport=args.transport, key=key, insecure=args.insecure,
            verify_checksum=args.verify_checksum,
        )
    except (OSError, RuntimeError, ValueError, ImportError) as exc:
        print(f"kvstage prefill: cannot start on {args.listen} ({ucx}): {exc}", file=sys.stderr)
        return net.EXIT_UNUSABLE_PEER

    def stop(signum: int, _frame: FrameType | None) -> None:
        worker.stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    h, p = worker.address
    lay = worker.layout
    print(f"kvstage prefill listening on {h}:{p} engine={worker.engine_id} preset={lay.name} "
          f"groups={lay.num_groups} tensors={lay.num_tensors} blocks={lay.num_blocks} "
          f"host={worker.host.nbytes >> 20} MiB "
          f"auth={'key' if key is not None else 'none'}", flush=True)
    print(f"kvstage prefill {ucx}", flush=True)
    try:
        worker.serve_forever()
    finally:
        s = worker.stats()
        worker.close()
        print(f"kvstage prefill stopped: prefilled={s.prefilled} completed={s.completed} "
              f"released={s.released} expired={s.expired} held_at_stop={s.held_requests}",
              flush=True)
    return 0
