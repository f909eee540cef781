"""Tier 0: the snapshot directory itself, which every tier builds on.

format.py     the manifest's wire format; reading and validating a snapshot directory
compat.py     the compat key: what a snapshot is valid for, and the check that refuses the rest
signature.py  snapshot keys: the manifest signed where it is made, checked before it is trusted
publish.py    fill a staging dir, write the manifest last, install it atomically
staging.py    staging directories and their cleanup
digests.py    sha256 over byte ranges, in parallel threads
pagecache.py  page-cache pre-warm, residency and drop
compile_caches.py  Triton, inductor, flashinfer and DeepGEMM caches: set up, saved, restored
bandwidth.py  the H2D and disk floors a restore is measured against
"""
