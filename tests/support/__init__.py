"""What the tests share, imported as ``tests.support.NAME`` from every room: oracles, the gloo process pool, the
config factory, spec and template edits, the simulated internode kernels, stand-ins for the device."""
