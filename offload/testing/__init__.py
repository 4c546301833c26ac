"""Test support that ships with the library (chaos delays on the copy lanes); not part of the public API."""
