"""audit/runtime"""
