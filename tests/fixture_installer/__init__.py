"""Tests of the fixture installer ISO (fixtures/installer): unit tests and real VM boots."""
