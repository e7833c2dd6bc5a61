"""Fault fakes loaded into engines from outside the product (never imported by kvstage)."""
