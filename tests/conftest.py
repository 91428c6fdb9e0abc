"""Shared pytest setup. Fixtures for the real local Slurm cluster live in slurm_fixture.py."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest_plugins = ["slurm_fixture"]
