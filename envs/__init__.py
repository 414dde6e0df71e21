"""Gymnasium text-generation environments for verifiable math tasks."""
