"""XTREME's metrics, exactly as its leaderboard computes them. Built in a later issue."""
