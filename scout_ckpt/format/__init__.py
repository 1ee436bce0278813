"""The on-disk truth: ROOT layout and atomic writes, the manifest, file digests, the DCP readers and restricted
unpicklers, the one-pass scan and byte verification. Torch-free (the readers stand in for DCP's classes) and
never importing the wings above it, so offline tools can read any ROOT."""
