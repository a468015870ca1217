"""shoal.tui: the Textual dashboard; imports shoal.protocol only."""
