"""The restore layout: raw, aligned tensor extents in one file per rank with a JSON table,
written once and streamed back into preallocated memory, every chunk verified.

    table.py         the layout's JSON table (wire format)
    writer.py        a layout file written atomically, digested as it goes
    streamer.py      `WeightStreamer`: fills tensors from a layout file, chunks verified
    read_plan.py     the read plan and the byte views reads fill
    chunk_checks.py  which chunk check runs, and the host-side checks
    cuda_copies.py   the CUDA path's copies, queued with no host sync per chunk
    checksum.py      sum64, the position-weighted chunk checksum (CPU and CUDA alike)
    preads.py        positional reads that fill byte views exactly
image.py         a span's live memory as a layout: each run one range of the file
"""
