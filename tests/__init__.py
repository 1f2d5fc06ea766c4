"""The test suite, a package: helpers are imported by their full name (tests.stack,
tests.pools.pool_support, ...), and pytest's default import mode puts the repository root, the
folder above this package, on sys.path. specdec and the services come from the editable install."""
