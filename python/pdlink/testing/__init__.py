"""Test beds for pdlink and for the programs built on it; imported only explicitly (``import pdlink``
never loads this package).

``pdlink.testing.hosts``: many emulated hosts on one machine (network, pid and mount namespaces
joined by one switch, with an emulated wire); docs/hosts.md.
"""
