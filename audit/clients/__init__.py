"""audit/clients"""
