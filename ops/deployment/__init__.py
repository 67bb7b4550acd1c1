"""Deployment orchestration, run by the operator: processes (launch), the one-command loopback
deployment (deploy), certificates and keys (certs)."""
