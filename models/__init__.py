"""The ground floor: tables, the database session and the state machine.

Nothing here imports the rest of voice-tools.
"""
