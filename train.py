"""The command line and the one training loop every method plugs into. Built in a later issue."""
