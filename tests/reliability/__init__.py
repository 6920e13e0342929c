"""Reliability tests (issue 10): each case of docs/reliability.md reproduced and its fix proved."""
