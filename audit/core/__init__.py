"""audit/core"""
