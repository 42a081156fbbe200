"""``python -m lit_efficient.transport.nccl_check DIR``: replay a run recorded with
``LIT_EFFICIENT_P2P_TRACE=DIR`` under NCCL's ordering rule (`lit_efficient.transport.p2p_trace`), e.g. your
own config on CPU before renting GPUs::

    LIT_EFFICIENT_P2P_TRACE=/tmp/trace lit-efficient fit --config my.yaml --trainer.accelerator cpu \
        --trainer.max_steps 5
    python -m lit_efficient.transport.nccl_check /tmp/trace
"""

from lit_efficient.transport.p2p_trace import main

if __name__ == "__main__":
    raise SystemExit(main())
