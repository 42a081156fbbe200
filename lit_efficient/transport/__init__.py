"""How stages' messages travel: process-group links (`process`, NCCL-safe order), in-process links (`local`),
the collectives over packed buffers (`collectives`), the wire format (`wire`), and the recorder and replay that
prove the point-to-point order safe under NCCL (`p2p_trace`, `nccl_check`).

Imports the runtime layer only (docs/DESIGN.md, "Layout").
"""
