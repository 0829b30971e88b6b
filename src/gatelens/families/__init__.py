"""Families: everything gatelens needs to know about one kind of recurrent module."""
