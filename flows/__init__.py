"""Prefect wiring only: flows, tasks wrapped around components, deployments, the CLI."""
