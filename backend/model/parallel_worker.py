"""Tensor-parallel follower processes (ranks > 0).

    python -m backend.model.parallel_worker --rank R --local-rank L --world-size W --master-addr A --master-port P
        one follower (rank 0 starts these for its own node when LoadModel asks for tensor_parallel_size > 1)
    python -m backend.model.parallel_worker --node-rank N --nnodes M --tp-size W --master-addr A --master-port P
        every rank of node N (N > 0) of a multi-node world, started again after each model unload

Followers take the model directory and engine settings from rank 0 (the path must exist on every node).
"""
import argparse
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

log = logging.getLogger("kimi-linear")


def run_node(args):
    from backend.model.parallel import spawn_follower

    per_node = args.tp_size // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    while True:
        procs = [spawn_follower(r, i, args.tp_size, args.master_addr, args.master_port) for i, r in enumerate(ranks)]
        codes = [p.wait() for p in procs]
        log.info("node %d: followers exited with %s; waiting for the next model load", args.node_rank, codes)
        if any(codes):
            time.sleep(5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--local-rank", type=int, default=0)
    ap.add_argument("--world-size", "--tp-size", dest="tp_size", type=int, required=True)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KIMI_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{args.rank}: %(message)s")
    if args.rank is None:
        if not 0 < args.node_rank < args.nnodes or args.tp_size % args.nnodes:
            ap.error("a node launcher needs 0 < --node-rank < --nnodes and --nnodes dividing --tp-size")
        try:
            run_node(args)
        except KeyboardInterrupt:
            pass
        return
    from backend.model.parallel import follow, join

    g = join(args.rank, args.local_rank, args.tp_size, args.master_addr, args.master_port)
    follow(g, init_group=True)


if __name__ == "__main__":
    main()
